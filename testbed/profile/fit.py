"""Fit a device profile to measured step times, and check a fitted one (``docs/devices.md``).

The prediction is the pacer's own arithmetic (``workers.device``), so a fitted profile paces
the emulation exactly as it reproduces the measurements. A measurement in another dtype
than the model card's (FP8 against a BF16 card) is priced with that dtype's weight and KV
bytes and the peak scaled by the byte ratio (tensor cores: FP8 peak = 2 x BF16 peak).
The fit minimises the squared log ratio of predicted to measured times with scipy's bounded
least squares, from a few starting points (the roofline's max makes local minima).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from testbed.errors import InputError
from testbed.hardware import DeviceProfile, ModelCard
from testbed.profile.measurements import Measurement
from workers.device import Pacer, make_pacer

TOLERANCE = 0.15  # a fitted profile reproduces each of its measurements within this (relative)
FREE = ("compute_efficiency", "decode_compute_efficiency", "bandwidth_efficiency", "step_overhead_ms",
        "allreduce_us")
BOUNDS = {"compute_efficiency": (0.02, 1.0), "decode_compute_efficiency": (0.02, 1.0),
          "bandwidth_efficiency": (0.02, 1.0), "step_overhead_ms": (0.0, 100.0),
          "allreduce_us": (0.0, 2000.0)}  # fmt: skip
STARTS = ((0.5, 0.5, 0.7, 2.0, 20.0), (0.9, 0.9, 0.9, 0.1, 5.0), (0.2, 0.2, 0.3, 10.0, 100.0))


@dataclass(frozen=True)
class Residual:
    measurement: Measurement
    predicted_ms: float

    @property
    def error(self) -> float:
        """Predicted over measured, minus one."""
        return self.predicted_ms / self.measurement.ms - 1


def predict_ms(profile: DeviceProfile, card: ModelCard, m: Measurement) -> float:
    dtype = m.dtype_bytes or card.dtype_bytes
    pacer = make_pacer(profile.spec("fit", m.devices, peak_scale=card.dtype_bytes / dtype), card.cost(dtype))
    if m.kind == "prefill":
        s = pacer.prefill_emulated(m.tokens, m.context) if m.batch == 1 else _batched_prefill(pacer, m)
    elif m.kind == "decode":
        s = pacer.decode_emulated([m.context] * m.batch, m.tokens)
    else:  # a static batch: the prefill makes the first token, each further one is a decode step
        s = _batched_prefill(pacer, m) + pacer.decode_emulated([m.context + 1] * m.batch, m.tokens - 1)
    return s * 1e3


def _batched_prefill(pacer: Pacer, m: Measurement) -> float:
    """One pass over ``batch`` sequences at once (a static batch's context phase)."""
    c = pacer.cost
    assert c is not None
    new, cached = (m.tokens, m.context) if m.kind == "prefill" else (m.context, 0)
    flops = m.batch * (2 * c.params * new + 4 * c.layers * c.hidden * new * (cached + new / 2))
    nbytes = c.weight_bytes + m.batch * c.kv_bytes_per_token * (cached + new)
    return pacer.pass_emulated(flops, nbytes, m.batch * new)


def check(profile: DeviceProfile, card: ModelCard, rows: Iterable[Measurement]) -> list[Residual]:
    return [Residual(m, predict_ms(profile, card, m)) for m in rows]


def fit(profile: DeviceProfile, card: ModelCard, rows: list[Measurement]) -> tuple[DeviceProfile, list[Residual]]:
    """The profile with its efficiencies, overhead and (when some measurement ran on several
    devices) all-reduce latency fitted; datasheet peak, bandwidth, link and chunk stay. A
    decode compute efficiency that no measurement depends on (no decode pass near the
    compute roof) is left unset: it follows the compute efficiency."""
    from scipy.optimize import least_squares  # heavy: only ``testbed profile fit`` needs it

    decodes = any(m.kind != "prefill" for m in rows)
    free = [f for f in FREE if (f != "allreduce_us" or any(m.devices > 1 for m in rows))
            and (f != "decode_compute_efficiency" or decodes)]
    if len(rows) < len(free):
        raise InputError(f"{len(rows)} measurements cannot determine {len(free)} parameters ({', '.join(free)})")
    lo = np.array([BOUNDS[f][0] for f in free])
    hi = np.array([BOUNDS[f][1] for f in free])

    def with_params(x: np.ndarray) -> DeviceProfile:
        return profile.model_copy(update={f: float(v) for f, v in zip(free, x, strict=True)})

    def residuals(x: np.ndarray) -> np.ndarray:
        p = with_params(x)
        return np.array([math.log(predict_ms(p, card, m) / m.ms) for m in rows])

    best = None
    for start in STARTS:
        x0 = np.clip(np.array([start[FREE.index(f)] for f in free]), lo, hi)
        result = least_squares(residuals, x0, bounds=(lo, hi), x_scale=np.maximum(hi - lo, 1e-9) / 10)
        if best is None or result.cost < best.cost:
            best = result
    assert best is not None
    fitted = with_params(best.x)
    if "decode_compute_efficiency" in free:
        unset = fitted.model_copy(update={"decode_compute_efficiency": None})
        if np.allclose(residuals(best.x), [math.log(predict_ms(unset, card, m) / m.ms) for m in rows], atol=1e-3):
            fitted = unset
    return fitted, check(fitted, card, rows)


def table(residuals: list[Residual]) -> str:
    """Measured vs modeled, one line per measurement."""
    head = f"{'line':>5} {'kind':<8} {'tokens':>7} {'context':>7} {'batch':>5} {'dev':>3} {'dtype':>5} " \
           f"{'measured ms':>12} {'model ms':>10} {'error':>7}"
    lines = [head]
    for r in residuals:
        m = r.measurement
        flag = "" if abs(r.error) <= TOLERANCE else "  <- outside +-15 %"
        lines.append(f"{m.line:>5} {m.kind:<8} {m.tokens:>7} {m.context:>7} {m.batch:>5} {m.devices:>3} "
                     f"{m.dtype_bytes or '-':>5} {m.ms:>12.2f} {r.predicted_ms:>10.2f} {r.error:>+7.1%}{flag}")
    return "\n".join(lines)
