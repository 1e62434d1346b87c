"""Means over repetitions with a 95 % confidence interval (Student's t), for tables that say n.

``mean_ci`` gives the mean and the half-width ``t(0.975, n - 1) x s / sqrt(n)`` (``s``: the
sample standard deviation). With one value there is no interval (half-width ``None``).
The t quantiles are the standard table's, to three decimals; above 30 degrees of freedom
the next tabulated smaller one is used (a slightly wider, never narrower, interval).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# t(0.975, df) for df = 1..30, then 40, 60, 120 (and the normal quantile beyond).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two values")
    if df in T975:
        return T975[df]
    below = [k for k in T975 if k < df]
    return T975[max(below)] if df <= 120 else 1.960


@dataclass(frozen=True)
class MeanCi:
    mean: float
    half: float | None  # half-width of the 95 % interval; None with a single value
    n: int

    def format(self, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        m = fmt.format(self.mean * scale)
        return m if self.half is None else f"{m} ± {fmt.format(self.half * scale).lstrip('+')}"


def mean_ci(values: Sequence[float]) -> MeanCi | None:
    """``None`` for no values (a metric no repetition measured)."""
    vs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vs:
        return None
    if len(vs) == 1:
        return MeanCi(vs[0], None, 1)
    return MeanCi(statistics.fmean(vs), t975(len(vs) - 1) * statistics.stdev(vs) / math.sqrt(len(vs)), len(vs))
