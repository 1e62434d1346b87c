"""Device profiles: emulate a heterogeneous accelerator by pacing real computation.

A worker does the real computation, then waits until the *modeled* time of that step has
passed. The model is a roofline: ``overhead + max(FLOPs / peak, bytes moved / bandwidth)``
with FLOPs and bytes computed from the work actually done (tokens, context, batch). If the
real computation took longer than the model says, the step is an *overrun*: the emulated
chip was slower than intended. Overruns are counted and reported, never hidden.
``native`` does no pacing (the CPU is the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.contracts import DeviceReport, DeviceSpec


@dataclass(frozen=True)
class ModelCost:
    params: int
    layers: int
    hidden: int
    kv_bytes_per_token: int
    weight_bytes: int


@dataclass
class Pacer:
    name: str
    peak_flops: float | None = None  # None = native
    mem_bps: float | None = None
    overhead_s: float = 0.0
    steps: int = 0
    overruns: int = 0
    overrun_s: float = 0.0
    modeled_s: float = 0.0
    real_s: float = 0.0
    history: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def native(self) -> bool:
        return self.peak_flops is None

    def _roofline(self, flops: float, nbytes: float) -> float:
        assert self.peak_flops and self.mem_bps
        return self.overhead_s + max(flops / self.peak_flops, nbytes / self.mem_bps)

    def prefill_time(self, m: ModelCost, new: int, cached: int) -> float:
        attn = 4 * m.layers * m.hidden * new * (cached + new / 2)
        flops = 2 * m.params * new + attn
        nbytes = m.weight_bytes + m.kv_bytes_per_token * (cached + new)
        return self._roofline(flops, nbytes)

    def decode_time(self, m: ModelCost, contexts: list[int], tokens_each: int = 1) -> float:
        flops = sum(2 * m.params * tokens_each + 4 * m.layers * m.hidden * c * tokens_each for c in contexts)
        nbytes = m.weight_bytes + m.kv_bytes_per_token * sum(contexts)
        return self._roofline(flops, nbytes)

    def account(self, kind: str, real_s: float, modeled_s: float | None) -> float:
        """Record a step; returns how long to wait so the step lasts ``modeled_s``."""
        self.steps += 1
        self.real_s += real_s
        if modeled_s is None:
            self.modeled_s += real_s
            return 0.0
        self.modeled_s += modeled_s
        if len(self.history) < 10000:
            self.history.append((kind, real_s, modeled_s))
        if real_s > modeled_s:
            self.overruns += 1
            self.overrun_s += real_s - modeled_s
            return 0.0
        return modeled_s - real_s

    def report(self) -> DeviceReport:
        return DeviceReport(device=self.name, steps=self.steps, overruns=self.overruns,
                            overrun_s=round(self.overrun_s, 4), modeled_s=round(self.modeled_s, 4),
                            real_s=round(self.real_s, 4))


def make_pacer(dev: DeviceSpec) -> Pacer:
    if dev.peak_tflops is None:
        return Pacer(dev.name)
    return Pacer(dev.name, dev.peak_tflops * 1e12, (dev.mem_gbps or 0) * 1e9, dev.step_overhead_ms / 1e3)
