"""PDD's benefit across prefix-hit rates (``testbed sweep --hit-rate A:B:STEP``): the bathtub.

``with_hit_rate`` rewrites a trace so that every request's prompt is a prefix of one
common token stream, ``h`` of its length, followed by tokens of its own: a request finds
``h`` of its prompt in a prefix cache once any earlier request has sent a prefix as long
(the first few requests warm it up; ``hit_trace`` is the rate an unbounded cache would
see, ``hit_measured`` what the prefill instances found). Lengths, outputs, sessions and
timing stay the trace's, so only the hit rate moves between points.

At each rate the policies run at one load; the benefit is PDD's change against the first
policy (the baseline, same-dc by default) in mean and P50 TTFT and in SLO attainment.
What shapes the curve: with a high hit rate little is prefilled, so prefill is fast
everywhere and the KV crossing the WAN is small; with a low one the prefill dominates
every policy alike; in between, the new tokens of each request become a chunked prefill
whose last chunk (the "tail chunk") is a short pass priced at a full step's overhead
(``DeviceProfile.prefill_chunk``, ``step_overhead_ms``), and the KV to move is largest
relative to the time saved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict

from protocol.worker_config import WorkerStats
from testbed.analysis.results import load_run, write_csv
from testbed.analysis.tables import table_head
from testbed.experiments.load_sweep import SweepOptions, fixed_dilation
from testbed.outputs import write_atomic
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.stats import hit_rates
from testbed.traces.workload import Segment, Workload

COMMON_STREAM = "hit-rate-common"


def with_hit_rate(wl: Workload, h: float) -> Workload:
    """``wl`` with each prompt = the common stream's first ``round(h * n)`` tokens + ``n -
    that`` tokens of the request's own (``n`` its input length, unchanged)."""
    if not 0 <= h <= 1:
        raise ValueError(f"hit rate {h} outside [0, 1]")
    out = []
    for r in wl.requests:
        n = r.input_len
        shared = round(h * n)
        segs = [Segment(COMMON_STREAM, shared)] if shared else []
        if n - shared:
            segs.append(Segment(f"hit-rate-own-{r.rid}", n - shared))
        out.append(dataclasses.replace(r, segments=segs))
    return dataclasses.replace(wl, requests=out, meta={**wl.meta, "hit_rate": h})


class HitPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hit_target: float
    hit_trace: float  # mean over requests, with an unbounded cache
    hit_measured: float | None  # mean prefill hit of completed requests
    policy: str
    run_dir: str
    completed: int
    requests: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    slo_attainment: float | None
    pass_fill: float | None = None  # packed prefill passes: emulated tokens over passes x budget (None: unpacked)


def pass_fill(workers: dict[str, WorkerStats], budget: int | None) -> float | None:
    """How full a policy's packed prefill passes ran: the emulated tokens they computed over
    passes x budget (None: its prefills ran one request at a time)."""
    counts = [w.prefill for w in workers.values() if w.prefill is not None and w.prefill.packed_passes]
    if not budget or not counts:
        return None
    return sum(c.packed_tokens for c in counts) / (budget * sum(c.packed_passes for c in counts))


def _change(new: float | None, base: float | None) -> float | None:
    return None if new is None or not base else new / base - 1


def benefit(points: list[HitPoint], baseline: str, policy: str) -> pd.DataFrame:
    """Per hit rate: ``policy`` against ``baseline`` (relative TTFT changes, negative =
    faster; SLO attainment difference in points)."""
    rows = []
    for h in sorted({p.hit_target for p in points}):
        at = {p.policy: p for p in points if p.hit_target == h}
        b, p = at.get(baseline), at.get(policy)
        if b is None or p is None:
            continue
        slo = (None if p.slo_attainment is None or b.slo_attainment is None
               else 100 * (p.slo_attainment - b.slo_attainment))
        rows.append({"hit_target": h, "hit_measured": p.hit_measured,
                     "ttft_mean_change": _change(p.ttft_mean_s, b.ttft_mean_s),
                     "ttft_p50_change": _change(p.ttft_p50_s, b.ttft_p50_s), "slo_points": slo,
                     "pass_fill": p.pass_fill, "base_pass_fill": b.pass_fill})
    return pd.DataFrame(rows)


def compared(labels: list[str]) -> tuple[str, str]:
    """The baseline (the first policy, in the order run) and the policy set against it (PDD,
    else the last); from the policies asked or, rebuilding, from the saved points' labels."""
    return labels[0], next((lab for lab in labels if lab.split(":")[0] == "pdd"), labels[-1])


def hit_sweep(sc: Scenario, wl: Workload, policies: list[PolicySpec], rates: list[float], load: float,
              opts: SweepOptions) -> tuple[list[HitPoint], pd.DataFrame]:
    """Every policy at every hit rate (one dilation for all), saved as bathtub.csv/.png/.md."""
    from testbed.experiments.parallel import Replay, run_all, saved

    run = fixed_dilation(sc, wl, opts.run)
    points: list[HitPoint] = []
    workloads = {h: with_hit_rate(wl, h) for h in rates}
    trace_hits = {h: sum(hit_rates(w).values()) / len(w.requests) for h, w in workloads.items()}
    for h in rates:
        print(f"\n== hit rate {h:g} (an unbounded cache would see {100 * trace_hits[h]:.1f} %) -> "
              f"{opts.out / f'hit-{h:g}'}", flush=True)
    run_all([Replay(sc, workloads[h], policies, dataclasses.replace(run, speed=load, out=opts.out / f"hit-{h:g}",
                                                                    allow_infidelity=True)) for h in rates])
    present = saved([opts.out / f"hit-{h:g}" for h in rates])
    for h in rates:
        run_dir, trace_hit = opts.out / f"hit-{h:g}", trace_hits[h]
        if run_dir not in present:
            continue
        summary, df = load_run(run_dir)
        budget = summary.scenario.workers.prefill_token_budget
        for name, s in summary.policies.items():
            ok = df[(df.policy == name) & df.ok & df.prefill_hit_tokens.notna()]
            measured = float((ok.prefill_hit_tokens / ok.prompt_tokens.clip(lower=1)).mean()) if len(ok) else None
            points.append(HitPoint(hit_target=h, hit_trace=trace_hit, hit_measured=measured, policy=name,
                                   run_dir=str(run_dir), completed=s.completed, requests=s.requests,
                                   ttft_mean_s=s.ttft_mean_s, ttft_p50_s=s.ttft_p50_s, ttft_p99_s=s.ttft_p99_s,
                                   slo_attainment=s.slo_attainment,
                                   pass_fill=pass_fill(summary.workers.get(name, {}), budget)))
    base, pdd = compared([p.label for p in policies])
    curve = benefit(points, base, pdd)
    save_bathtub(points, curve, opts.out, base, pdd)
    return points, curve


def save_bathtub(points: list[HitPoint], curve: pd.DataFrame, out: Path, base: str, pdd: str) -> list[Path]:
    from testbed.analysis import plots

    out.mkdir(parents=True, exist_ok=True)
    write_csv(pd.DataFrame([p.model_dump() for p in points]), out / "bathtub_points.csv")
    write_csv(curve, out / "bathtub.csv")
    plots.plot_bathtub(curve, out / "bathtub.png", base, pdd)
    lines = [f"# {pdd} against {base} across prefix-hit rates", "",
             *table_head(["hit rate", "measured hit", "mean TTFT", "P50 TTFT", "SLO met (points)",
                          f"prefill passes full ({pdd} / {base})"], "rrrrrr")]

    def pct(v: float | None, sign: str = "+") -> str:
        return "-" if v is None or pd.isna(v) else f"{100 * v:{sign}.1f} %"

    for r in curve.itertuples():
        slo = "-" if r.slo_points is None or pd.isna(r.slo_points) else f"{r.slo_points:+.1f}"
        fill = f"{pct(getattr(r, 'pass_fill', None), '')} / {pct(getattr(r, 'base_pass_fill', None), '')}"
        lines.append(f"| {r.hit_target:g} | {pct(r.hit_measured, '')} | {pct(r.ttft_mean_change)} | "
                     f"{pct(r.ttft_p50_change)} | {slo} | {fill} |")
    write_atomic(out / "bathtub.md", "\n".join(lines) + "\n")
    return [out / "bathtub_points.csv", out / "bathtub.csv", out / "bathtub.png", out / "bathtub.md"]
