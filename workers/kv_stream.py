"""KV streamed as it is computed (``kv_transfer: per-chunk`` and ``per-layer``).

An engine that streams KV sends a chunk's KV as soon as the prefill pass that computed it
ends, so that the transfer overlaps the rest of the prefill; only the last chunk's KV is
left to cross once the prefill is done. Per layer (``per-layer``: ``LayerOrder``), a pass's KV
leaves in layer groups as the pass computes them: a pass's time is split evenly over the
model's layers (the device model prices a pass as a whole; each layer is an equal share of
its FLOPs and bytes), group ``g`` of ``G`` is computed ``(g + 1) / G`` of the way through the
pass, the last one when the pass ends; only the last group of the last pass is then left to
cross. A prompt of one pass, which per-chunk cannot overlap at all, overlaps here.

A prefill's passes are known in advance when it runs alone (the device model prices each
one: ``Pacer.prefill_schedule``), and each as it starts and ends when passes pack several
requests (``Computed.passing``, ``Computed.passed``), so a transfer is handed the time each
part of its KV is computed, and a frame leaves only once all its tokens are. The same
``Computed`` is read by both transports (``kv_wire._send`` before each frame, the
simulator's sender before each burst), so the two engines stream alike.

The real small model computes the whole prompt in one call before any pacing: a frame due
before that call returned leaves when it returns (the compute's real time, which the
fidelity verdict already bounds by the modeled time).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence

from protocol import clock

# A due time counts as reached this close to it: a timer set for ``due - now`` wakes at a
# float that may fall an ulp short of ``due`` (the simulator's virtual clock does), and
# waiting again for that ulp would never advance.
DUE_EPS_S = 1e-9


class Computed:
    """When each part of a prompt's KV is computed, on ``clock.monotonic``: every pass known
    when the prefill starts (one request at a time, ``schedule``), or added as each pass ends
    (passes packing several requests: ``passed``)."""

    def __init__(self, start: float, hit: int, done: Sequence[int] = (), at: Sequence[float] = (),
                 final: bool = True) -> None:
        self.start = start  # the prefill's start
        self.hit = hit  # tokens the prefill had cached: their KV is there at once
        self.done = list(done)  # per pass: tokens after ``hit`` computed by its end (increasing)
        self.at = list(at)  # per pass: seconds from ``start`` to its end
        self.final = final  # every pass is known (False: ``passed`` adds them as they end)
        # Per pass as it starts (``passing``; known in advance with ``final``): its tokens done
        # by its end, and seconds from ``start`` to its start and to its planned end.
        self.announced = list(done)
        self.began = [0.0, *self.at[:-1]]
        self.planned = list(self.at)
        self._more = asyncio.Event()

    def passing(self, done: int, began: float, planned: float) -> None:
        """A pass starts at ``began`` and will end about ``planned``: ``done`` tokens after
        ``hit`` are computed by its end (per-layer transfers read a pass's groups from this)."""
        self.announced.append(done)
        self.began.append(began - self.start)
        self.planned.append(planned - self.start)
        self._more.set()
        self._more = asyncio.Event()

    def passed(self, done: int, now: float) -> None:
        """A pass ended at ``now``: ``done`` tokens after ``hit`` are computed."""
        self.done.append(done)
        self.at.append(now - self.start)
        self._more.set()
        self._more = asyncio.Event()

    def due(self, tokens: int) -> float | None:
        """When the KV of the prompt's first ``tokens`` tokens is all computed (None: not
        known yet, a pass still to come)."""
        need = tokens - self.hit
        if need <= 0 or (not self.done and self.final):
            return self.start
        i = bisect.bisect_left(self.done, need)
        if i == len(self.done):
            return self.start + self.at[-1] if self.final else None
        return self.start + self.at[i]

    def ready(self, now: float) -> int:
        """Tokens (from the prompt's first) whose KV is computed at ``now``."""
        i = bisect.bisect_right(self.at, now - self.start + DUE_EPS_S)
        return self.hit + (self.done[i - 1] if i else 0)

    def layer_due(self, tokens: int, group: int, groups: int) -> float | None:
        """When layer group ``group`` of ``groups`` of the first ``tokens`` tokens' KV is all
        computed (None: not known yet): ``group + 1`` groups' share of the way through the pass
        that computes the last of them, the last group when that pass has ended."""
        need = tokens - self.hit
        if need <= 0 or (not self.announced and self.final):
            return self.start
        if group == groups - 1:
            return self.due(tokens)
        p = bisect.bisect_left(self.announced, need)
        if p == len(self.announced):
            return self.start + self.at[-1] if self.final else None
        return self.start + self.began[p] + (group + 1) / groups * (self.planned[p] - self.began[p])

    async def until(self, tokens: int, stops: Sequence[asyncio.Event] = (), group: int = 0,
                    groups: int = 1) -> bool:
        """Wait until the first ``tokens`` tokens' KV (of layer group ``group`` of ``groups``)
        is computed; False when one of ``stops`` is set first."""
        while not any(ev.is_set() for ev in stops):
            due = self.due(tokens) if groups == 1 else self.layer_due(tokens, group, groups)
            wait = None if due is None else due - clock.monotonic()
            if wait is not None and wait <= DUE_EPS_S:
                break
            waits = [asyncio.ensure_future(ev.wait()) for ev in (*stops, self._more)]
            try:
                await asyncio.wait(waits, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return not any(ev.is_set() for ev in stops)


def schedule(start: float, hit: int, steps: list[tuple[int, float]]) -> Computed:
    """A ``Computed`` from ``Pacer.prefill_schedule``'s passes."""
    return Computed(start, hit, [d for d, _ in steps], [t for _, t in steps])


class LayerOrder:
    """A per-layer transfer's frames, (layer group, first token), in the order their KV is
    computed: pass by pass (the frames whose last token that pass computes; first those the
    prefill had cached), within a pass group by group, within a group token by token. Frame
    ``j`` of it travels on connection ``j % k`` (``kv_stripes``); a pass's frames are known
    once the pass has started (``Computed.passing``), all of them when the passes are known in
    advance."""

    def __init__(self, computed: Computed, have: int, n: int, per_frame: int, groups: int) -> None:
        self.computed, self.groups, self.n, self.per_frame = computed, groups, n, per_frame
        self.starts = list(range(have, n, per_frame))
        self.frames: list[tuple[int, int]] = []
        self._next = 0  # the first token frame not yet ordered
        self._pass = -1  # the next pass to order (-1: what was cached)

    def _extend(self) -> bool:
        """Order the next pass's frames, if it is known."""
        c = self.computed
        if self._pass >= len(c.announced) and not c.final:
            return False
        last = self._pass >= len(c.announced) - 1 and c.final  # the last known pass takes what is left
        limit = self.n if last else c.hit if self._pass < 0 else c.announced[self._pass] + c.hit
        fs = []
        while self._next < len(self.starts) and min(self.n, self.starts[self._next] + self.per_frame) <= limit:
            fs.append(self.starts[self._next])
            self._next += 1
        self.frames += [(g, f) for g in range(self.groups) for f in fs]
        self._pass += 1
        return True

    async def get(self, j: int, stops: Sequence[asyncio.Event] = ()) -> tuple[int, int] | None:
        """Frame ``j``, once it is known (None: there is none, or one of ``stops`` was set)."""
        while len(self.frames) <= j:
            if self._next == len(self.starts) or any(ev.is_set() for ev in stops):
                return None
            if not self._extend():
                waits = [asyncio.ensure_future(ev.wait()) for ev in (*stops, self.computed._more)]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        return self.frames[j]

    def due(self, frame: tuple[int, int]) -> float | None:
        g, start = frame
        return self.computed.layer_due(min(self.n, start + self.per_frame), g, self.groups)

    async def ready(self, frame: tuple[int, int], stops: Sequence[asyncio.Event] = ()) -> bool:
        """Wait until ``frame``'s KV is computed; False when one of ``stops`` is set first."""
        g, start = frame
        return await self.computed.until(min(self.n, start + self.per_frame), stops, g, self.groups)

    def last(self, j: int) -> bool:
        """No frame from ``j`` on is left to order (a sender's next frame would be past the end)."""
        return self._next == len(self.starts) and j >= len(self.frames)
