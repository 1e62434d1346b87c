"""Device profiles: emulate an accelerator running the emulated model by pacing real work.

A worker does the real computation with the small model, then waits until the *modeled*
time of the *emulated* work has passed (``docs/emulated-time.md``):

* a prefill of ``n`` new replayed tokens after ``c`` cached ones is priced as
  ``n x s_in`` new emulated tokens after ``c x s_in``, in passes of the device's
  ``prefill_chunk`` emulated tokens (each pass pays the per-step overhead: a small tail
  chunk costs nearly a whole step);
* a decode step that yields one replayed token per request is priced as ``s_out`` batched
  decode steps of the emulated model at the emulated contexts (``context x s_in``, growing
  by one per step);
* an extend of ``k`` tokens (PDD's handoff) is one pass over ``k x s_out`` tokens.

Each pass is a roofline: ``overhead + max(FLOPs / (peak x compute efficiency), bytes moved /
(bandwidth x bandwidth efficiency))`` (a decode pass with its own compute efficiency), with
``2 x params`` FLOPs per token plus attention (``4 x layers x width x context``) and the
weights plus the KV read per pass; an instance of ``n > 1`` accelerators adds two
all-reduces per layer, each ``latency + rows x width x dtype x 2(n-1)/n / link``. The
efficiencies and the overhead are fitted to measurements (``testbed profile fit``,
``docs/devices.md``). The modeled time is multiplied by the dilation ``D`` (real seconds per
emulated second). Real computation longer than that is an *overrun*:
counted per kind of step and reported, never hidden. ``native`` does no pacing (the host
CPU is the device).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from protocol import clock
from protocol.worker_config import (
    LATE_WAKE,
    LATE_WAKE_FLOOR_S,
    NEED_MIN_BUCKET,
    NEED_STEP,
    DeviceReport,
    DeviceSpec,
    ModelCost,
    Scales,
    WorstOverrun,
)

WORST_KEPT = 5


@dataclass
class Pacer:
    name: str
    cost: ModelCost | None = None  # None = native
    peak_flops: float = 0.0
    mem_bps: float = 0.0
    overhead_s: float = 0.0
    chunk: int | None = None
    decode_peak_flops: float = 0.0  # a decode pass's GEMMs are skinny: their own share of peak
    devices: int = 1
    allreduce_s: float = 0.0
    link_bps: float | None = None  # bytes per second per accelerator; None: free
    scales: Scales = field(default_factory=Scales)
    steps: int = 0
    overruns: int = 0
    overrun_s: float = 0.0
    modeled_s: float = 0.0
    real_s: float = 0.0
    by_kind: dict[str, list[int]] = field(default_factory=dict)
    # Steps that ended late although their work fit: the wait for the modeled end woke more
    # than LATE_WAKE of the step's modeled time after it (a busy event loop, a slow timer).
    late_wakes: int = 0
    late_s: float = 0.0
    late_max_s: float = 0.0
    # the largest overruns: (over, kind, real, modeled, t, detail)
    worst: list[tuple[float, str, float, float, float, str]] = field(default_factory=list)
    # Each paced step's need (``need_bucket``): how many times its modeled time it would have
    # needed not to overrun nor end late; counted per bucket, what the verdict reads a lower D from.
    needs: dict[int, int] = field(default_factory=dict)
    _need: float = 0.0  # the step being waited for: its real / modeled, until it wakes

    @property
    def native(self) -> bool:
        return self.cost is None

    # ----------------------------------------------------------------- emulated seconds
    def pass_emulated(self, flops: float, nbytes: float, rows: int, peak: float | None = None) -> float:
        """Emulated seconds of one forward pass: ``flops`` of work, ``nbytes`` read or
        written, ``rows`` tokens of activations (what a tensor-parallel all-reduce moves)."""
        t = self.overhead_s + max(flops / (peak or self.peak_flops), nbytes / self.mem_bps)
        if self.devices > 1:
            m = self.cost
            assert m is not None
            n = self.devices
            wire = 0.0 if self.link_bps is None else rows * m.hidden * m.dtype_bytes * 2 * (n - 1) / n / self.link_bps
            t += 2 * m.layers * (self.allreduce_s + wire)
        return t

    def prefill_emulated(self, new: int, cached: int) -> float:
        """Emulated seconds to prefill ``new`` emulated tokens after ``cached`` ones."""
        total = 0.0
        for _, t in self.prefill_passes(new, cached):
            total += t
        return total

    def prefill_passes(self, new: int, cached: int) -> Iterator[tuple[int, float]]:
        """Each pass of that prefill: the emulated tokens computed by its end (from the
        first new one), and its emulated seconds."""
        m = self.cost
        assert m is not None
        chunk = self.chunk or max(1, new)
        done = cached
        while done < cached + new:
            n = min(chunk, cached + new - done)
            flops = 2 * m.params * n + m.attention_flops(n, done + n / 2)
            nbytes = m.pass_weight_bytes(n) + m.kv_bytes_per_token * (done + n) + m.state_bytes
            done += n
            yield done - cached, self.pass_emulated(flops, nbytes, n)

    def decode_emulated(self, contexts: list[int], steps: int = 1) -> float:
        """Emulated seconds for ``steps`` batched decode steps at these emulated contexts."""
        m = self.cost
        assert m is not None
        total = 0.0
        for j in range(steps):
            rows = len(contexts)
            ctx = sum(contexts) + j * rows
            flops = 2 * m.params * rows + 4 * (m.attention_layers or m.layers) * m.hidden * ctx
            if m.window_layers:  # each request's window layers see at most the window
                flops += 4 * m.window_layers * m.hidden * sum(min(c + j, m.window) for c in contexts)
            flops += m.linear_flops_per_token * rows
            nbytes = m.pass_weight_bytes(rows) + m.kv_bytes_per_token * ctx + m.state_bytes * rows
            total += self.pass_emulated(flops, nbytes, rows, self.decode_peak_flops)
        return total

    def extend_emulated(self, context: int, tokens: int) -> float:
        """Emulated seconds for one pass over ``tokens`` known tokens after ``context``."""
        m = self.cost
        assert m is not None
        flops = 2 * m.params * tokens + m.attention_flops(tokens, context + tokens / 2)
        nbytes = m.pass_weight_bytes(tokens) + m.kv_bytes_per_token * (context + tokens) + m.state_bytes
        return self.pass_emulated(flops, nbytes, tokens)

    # ----------------------------------------------------------------- real seconds to pace to
    def prefill_time(self, new: int, cached: int) -> float:
        """Real seconds a prefill of ``new`` replayed tokens after ``cached`` must last."""
        s = self.scales
        return s.dilation * self.prefill_emulated(new * s.s_in, cached * s.s_in)

    def prefill_schedule(self, new: int, cached: int) -> list[tuple[int, float]]:
        """When a prefill of ``new`` replayed tokens after ``cached`` has computed what: per
        pass, the replayed tokens done by its end (counted from the first new one; the last
        pass all of them) and the real seconds from the prefill's start to that end."""
        s = self.scales
        out, at = [], 0.0
        for done, t in self.prefill_passes(new * s.s_in, cached * s.s_in):
            at += s.dilation * t
            out.append((min(new, done // s.s_in), at))
        if out:
            out[-1] = (new, out[-1][1])
        return out

    def packed_time(self, parts: list[tuple[int, int]]) -> float:
        """Real seconds of one prefill pass packing several requests' chunks: per part, the
        replayed tokens it computes and the replayed tokens of its request before them (each
        attends to its own context; the weights are read once for all)."""
        m, s = self.cost, self.scales
        assert m is not None
        rows = sum(n for n, _ in parts) * s.s_in
        flops = nbytes = 0.0
        for n, before in parts:
            new, done = n * s.s_in, before * s.s_in
            flops += 2 * m.params * new + m.attention_flops(new, done + new / 2)
            nbytes += m.kv_bytes_per_token * (done + new) + m.state_bytes
        return s.dilation * self.pass_emulated(flops, m.pass_weight_bytes(rows) + nbytes, rows)

    def mixed_room(self, rows: int, budget: int) -> int:
        """Replayed prompt tokens one step of a worker that prefills and decodes may carry
        beside ``rows`` decode tokens under a budget of ``budget`` emulated tokens a pass: a
        step with decodes stands for ``s_out`` emulated passes, each leaving ``budget - rows``
        to prompts (at least one token: a prompt is never starved for good); a step without
        is one pass of the whole budget, as a prefill worker's."""
        s = self.scales
        if rows == 0:
            return max(1, budget // s.s_in)
        return max(1, s.s_out * max(0, budget - rows) // s.s_in)

    def mixed_time(self, contexts: list[int], parts: list[tuple[int, int]], budget: int) -> tuple[float, list[float]]:
        """Real seconds of one step of a worker that prefills and decodes (``mixed_room``):
        ``contexts``, the replayed contexts of its decode rows; ``parts``, per prompt the
        replayed tokens it computes and the replayed tokens of its request before them. Its
        ``s_out`` emulated passes (one without decodes) each take a decode token per row and,
        in order, as much of the prompts as the budget leaves; a pass's FLOPs are priced at the
        prefill's efficiency for prompt tokens and the decode's for decode rows, the weights
        read once for all of them. Prompt tokens still left after those passes (a budget
        smaller than the rows) take passes of their own. Returns the step's real seconds and,
        per part, the real seconds from the step's start to the end of the pass that computed
        its last token (a prompt's first token is due then, not at the step's end)."""
        m, s = self.cost, self.scales
        assert m is not None
        rows = len(contexts)
        left = [[n * s.s_in, before * s.s_in] for n, before in parts]  # emulated: to compute, before
        room = budget if rows == 0 else max(1, budget - rows)
        total, j, i = 0.0, 0, 0
        ends = [0.0] * len(parts)
        while i < len(left) or (rows and j < s.s_out):
            decoding = rows if j < (s.s_out if rows else 0) else 0
            flops = nbytes = 0.0
            if decoding:
                ctx = sum(contexts) * s.s_in + j * rows
                flops = (2 * m.params * rows + 4 * (m.attention_layers or m.layers) * m.hidden * ctx
                         + m.linear_flops_per_token * rows)
                if m.window_layers:
                    flops += 4 * m.window_layers * m.hidden * sum(min(c * s.s_in + j, m.window) for c in contexts)
                nbytes = m.kv_bytes_per_token * ctx + m.state_bytes * rows
            tokens, free, ended = 0, room, []
            while free > 0 and i < len(left):
                n, before = min(left[i][0], free), left[i][1]
                # prompt FLOPs in decode-efficiency units (one pass, one roofline)
                flops += (2 * m.params * n + m.attention_flops(n, before + n / 2)) * (
                    self.decode_peak_flops / self.peak_flops if decoding else 1.0)
                nbytes += m.kv_bytes_per_token * (before + n) + m.state_bytes
                left[i] = [left[i][0] - n, before + n]
                tokens += n
                free -= n
                if left[i][0] == 0:
                    i += 1
                    ended.append(i - 1)
            nbytes += m.pass_weight_bytes(decoding + tokens)
            peak = self.decode_peak_flops if decoding else self.peak_flops
            total += self.pass_emulated(flops, nbytes, decoding + tokens, peak)
            for k in ended:
                ends[k] = s.dilation * total
            j += 1
        return s.dilation * total, ends

    def decode_time(self, contexts: list[int]) -> float:
        """Real seconds a decode step (one replayed token per request at these replayed
        contexts) must last."""
        s = self.scales
        return s.dilation * self.decode_emulated([c * s.s_in for c in contexts], s.s_out)

    def extend_time(self, context: int, tokens: int) -> float:
        s = self.scales
        return s.dilation * self.extend_emulated(context * s.s_in, tokens * s.s_out)

    # ----------------------------------------------------------------- accounting
    def account(self, kind: str, real_s: float, modeled_s: float | None, detail: str = "") -> float:
        """Record a step; returns how long to wait so the step lasts ``modeled_s``."""
        self.steps += 1
        self.real_s += real_s
        counts = self.by_kind.setdefault(kind, [0, 0])
        counts[0] += 1
        if modeled_s is None:
            self.modeled_s += real_s
            return 0.0
        self.modeled_s += modeled_s
        if modeled_s > 0:
            self._need = real_s / modeled_s
            if real_s >= modeled_s:  # no wait follows: its need is known now
                self._count_need(self._need)
        if real_s > modeled_s:
            self.overruns += 1
            counts[1] += 1
            self.overrun_s += real_s - modeled_s
            # The largest few, with when they happened: what a reader needs to find the cause.
            heapq.heappush(self.worst, (real_s - modeled_s, kind, real_s, modeled_s, clock.now(), detail))
            if len(self.worst) > WORST_KEPT:
                heapq.heappop(self.worst)
            return 0.0
        return modeled_s - real_s

    def woke(self, modeled_s: float, late_s: float) -> None:
        """The wait that ended a step of ``modeled_s`` real seconds woke ``late_s`` after
        the step's modeled end. Every step's end is a little late (the timer, the loop); what
        the run's figures feel is the sum, and a step late by more than LATE_WAKE of itself
        (and more than the host's timer noise, LATE_WAKE_FLOOR_S)."""
        late_s = max(0.0, late_s)
        if modeled_s > 0:  # at f x D it would end late once f x LATE_WAKE x modeled < late_s
            self._count_need(max(self._need, late_s / (LATE_WAKE * modeled_s) if late_s > LATE_WAKE_FLOOR_S else 0.0))
        self.late_s += late_s
        self.late_max_s = max(self.late_max_s, late_s)
        if late_s > max(LATE_WAKE * modeled_s, LATE_WAKE_FLOOR_S):
            self.late_wakes += 1

    def _count_need(self, need: float) -> None:
        k = need_bucket(need)
        self.needs[k] = self.needs.get(k, 0) + 1

    def report(self) -> DeviceReport:
        return DeviceReport(device=self.name, native=self.native, steps=self.steps, overruns=self.overruns,
                            overrun_s=round(self.overrun_s, 4), modeled_s=round(self.modeled_s, 4),
                            real_s=round(self.real_s, 4), late_wakes=self.late_wakes, late_s=round(self.late_s, 4),
                            late_max_s=round(self.late_max_s, 5),
                            by_kind={k: (v[0], v[1]) for k, v in self.by_kind.items()}, needs=dict(self.needs),
                            worst=[WorstOverrun(kind=k, real_s=round(r, 4), modeled_s=round(m, 4), t=t, detail=d)
                                   for _, k, r, m, t, d in sorted(self.worst, reverse=True)])


def need_bucket(need: float) -> int:
    """The bucket of a step's need (real / modeled, or what its late end asks): the smallest
    ``k`` with ``need <= NEED_STEP ** k``, at least ``NEED_MIN_BUCKET`` (needs below are alike)."""
    if need <= NEED_STEP**NEED_MIN_BUCKET:
        return NEED_MIN_BUCKET
    return max(NEED_MIN_BUCKET, math.ceil(math.log(need) / math.log(NEED_STEP) - 1e-9))


def make_pacer(dev: DeviceSpec, cost: ModelCost | None, scales: Scales | None = None) -> Pacer:
    """A pacer for ``dev`` pricing ``cost`` (the emulated model, or the real one when the
    scenario emulates none); native when the device has no roofline."""
    if dev.peak_tflops is None or dev.mem_gbps is None or cost is None:
        return Pacer(dev.name)
    decode_eff = dev.decode_compute_efficiency or dev.compute_efficiency
    return Pacer(dev.name, cost, peak_flops=dev.peak_tflops * 1e12 * dev.compute_efficiency,
                 decode_peak_flops=dev.peak_tflops * 1e12 * decode_eff,
                 mem_bps=dev.mem_gbps * 1e9 * dev.bandwidth_efficiency, overhead_s=dev.step_overhead_ms / 1e3,
                 chunk=dev.prefill_chunk, scales=scales or Scales(), devices=dev.devices,
                 allreduce_s=dev.allreduce_us / 1e6, link_bps=None if dev.link_gbps is None else dev.link_gbps * 1e9)
