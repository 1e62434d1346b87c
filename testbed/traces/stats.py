"""``testbed trace stats``: what a trace asks of the system, before running it.

Prefix hit rates are computed at block granularity with an unbounded prefix cache, in
arrival order: a request hits the longest run of its leading *full* blocks that an earlier
request already brought into the cache (a partial trailing block never hits), and its hit
rate is hit tokens / input tokens. Closed-loop turns are placed at their predecessor's
estimated send time plus their delay (service time unknown before the run), which is also
what the arrival rate is computed from.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from testbed.traces.workload import Workload, block_hashes

HIT_BUCKETS = [(0, 90), (90, 95), (95, 97), (97, 98), (98, 99), (99, 100)]


def hit_rates(wl: Workload, block: int | None = None, outputs_cached: bool = False) -> dict[str, float]:
    """Per request: fraction of its input tokens found in the (unbounded) prefix cache.
    ``outputs_cached``: a request's answer enters the cache after it, as in a scenario with
    ``workers.cache_outputs`` (otherwise only prompts are ever prefilled, so cached)."""
    block = block or wl.block_size
    est = wl.first_sent()
    cache: set[bytes] = set()
    out: dict[str, float] = {}
    for r in sorted(wl.requests, key=lambda r: est[r.rid]):
        hashes = block_hashes(r.segments, block)
        hit = 0
        while hit < len(hashes) and hashes[hit] in cache:
            hit += 1
        cache.update(hashes)
        if outputs_cached and r.answer is not None:
            cache.update(block_hashes([*r.segments, r.answer], block))
        out[r.rid] = hit * block / r.input_len
    return out


def _bucket(rate_pct: float) -> int:
    for k, (_lo, hi) in enumerate(HIT_BUCKETS):
        if rate_pct < hi or k == len(HIT_BUCKETS) - 1:
            return k
    return len(HIT_BUCKETS) - 1


class Spread(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    min: float


class TraceStats(BaseModel):
    """What ``testbed trace stats`` prints (and ``--json`` writes)."""

    model_config = ConfigDict(extra="forbid")

    trace: str
    format: str
    requests: int
    token_scale: int
    block_size: int
    meta: dict[str, Any] = {}  # the trace file's own header fields
    sessions: int
    closed_loop_turns: int
    input_tokens: Spread
    output_tokens: Spread
    duration_s: float
    arrival_rate_rps: float | None
    outputs_cached: bool = False  # hit rates with answers cached after their request
    mean_hit_rate: float
    hit_buckets: dict[str, float]  # "lo-hi%" -> share of requests
    share_above_95: float
    low_hit_short_output_share: float


def _pcts(values: list[int]) -> Spread:
    a = np.asarray(values, dtype=float)
    return Spread(mean=float(a.mean()), p50=float(np.percentile(a, 50)), p90=float(np.percentile(a, 90)),
                  p99=float(np.percentile(a, 99)), max=float(a.max()), min=float(a.min()))


def trace_stats(wl: Workload, block: int | None = None, outputs_cached: bool | None = None) -> TraceStats:
    """``outputs_cached`` None: as the generator's header says (``testbed trace gen
    --outputs-cached``), else not."""
    if outputs_cached is None:
        outputs_cached = bool(wl.meta.get("outputs_cached", False))
    rates = hit_rates(wl, block, outputs_cached)
    est = wl.first_sent()
    counts = [0] * len(HIT_BUCKETS)
    for v in rates.values():
        counts[_bucket(100 * v)] += 1
    n = len(wl.requests)
    span = max(est.values()) - min(est.values())
    low_hit_short = sum(1 for r in wl.requests if rates[r.rid] < 0.5 and r.output_len * 4 < r.input_len
                        and r.hints.short_output)
    return TraceStats(
        trace=str(wl.source), format=wl.format, requests=n, token_scale=wl.token_scale,
        block_size=block or wl.block_size, meta=wl.meta, outputs_cached=outputs_cached,
        sessions=len({r.session for r in wl.requests if r.session}),
        closed_loop_turns=sum(1 for r in wl.requests if r.after),
        input_tokens=_pcts([r.input_len for r in wl.requests]),
        output_tokens=_pcts([r.output_len for r in wl.requests]),
        duration_s=span, arrival_rate_rps=n / span if span > 0 else None,
        mean_hit_rate=float(np.mean(list(rates.values()))),
        hit_buckets={f"{lo}-{hi}%": c / n for (lo, hi), c in zip(HIT_BUCKETS, counts, strict=True)},
        share_above_95=sum(c for (lo, _), c in zip(HIT_BUCKETS, counts, strict=True) if lo >= 95) / n,
        low_hit_short_output_share=low_hit_short / n,
    )  # fmt: skip


def format_stats(s: TraceStats) -> str:
    def row(name: str, d: Spread) -> str:
        return (f"  {name:14} mean {d.mean:9.1f}  p50 {d.p50:8.0f}  p90 {d.p90:8.0f}  "
                f"p99 {d.p99:8.0f}  max {d.max:8.0f}")

    rate = s.arrival_rate_rps
    lines = [
        f"trace {s.trace} ({s.format}, token scale {s.token_scale}, block {s.block_size} tokens)",
        f"  requests {s.requests}" + (f" in {s.sessions} sessions ({s.closed_loop_turns} closed-loop turns)"
                                      if s.sessions else ""),
        f"  duration {s.duration_s:.1f} s, arrival rate " + (f"{rate:.2f} req/s" if rate else "-"),
        row("input tokens", s.input_tokens),
        row("output tokens", s.output_tokens),
        f"  prefix hit rate (unbounded cache, arrival order{', answers cached' if s.outputs_cached else ''}): "
        f"mean {100 * s.mean_hit_rate:.1f}%, "
        f"above 95%: {100 * s.share_above_95:.1f}% of requests",
    ]
    if isinstance(cap := s.meta.get("max_context"), dict):
        lines.insert(2, f"  max context {cap['tokens']} tokens: {cap['truncated']} of {cap['of']} prompts truncated "
                        f"to their last ones ({cap['dropped_tokens']} tokens dropped)")
    for name, share in s.hit_buckets.items():
        lines.append(f"    {name:8} {100 * share:5.1f}%  {'#' * round(50 * share)}")
    lines.append(f"  low-hit (<50%) short-output requests flagged short_output: "
                 f"{100 * s.low_hit_short_output_share:.1f}%")
    return "\n".join(lines)
