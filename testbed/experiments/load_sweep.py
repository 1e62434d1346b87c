"""Offered-load sweeps, SLA throughput and the load calibration: many ``testbed run``s.

A *point* is one ``testbed run`` of a trace at one load, saved in its own folder
(``load-1.5/``, rebuilt by ``testbed report``); load is a multiple of the trace's own
arrival rate (``testbed run --load``: arrivals and think times compressed by it). Every point of a
sweep runs at one dilation, found once (``auto``) before the first, so points compare.

* ``sla_throughput``: per policy, the highest load of the sweep at which at least
  ``share`` of the requests met the TTFT and TPOT objectives, every lower load meeting it
  too; the figure is that point's request rate (requests over the replay's emulated span,
  first sent to last token), and BCR divides it by the deployment's price.
* ``bisect_increasing``: the load at which an increasing response reaches a target,
  bisected in log space; it says when the target lies outside the range and gives the
  closest point instead.
* ``calibrate``: the report does not state its offered load, so the load is bisected until
  cross-dc minus same-dc P50 TTFT is +2.5 s; then every policy runs at that load, and the
  point's ``report.md`` puts the report's figures beside ours.

The hit-rate sweep (the bathtub) is ``testbed.experiments.hit_rate_sweep``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from testbed.analysis.cost import hardware_cost
from testbed.analysis.results import PolicySummary, load_run, write_csv
from testbed.analysis.tables import table_head
from testbed.deploy.dilation import emulation_plan
from testbed.engines import kind
from testbed.errors import InputError
from testbed.experiments.parallel import Replay, run_all, saved
from testbed.experiments.ray_executor import dilation_on_a_node
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.load.trace_replay import probe_replay
from testbed.outputs import write_atomic
from testbed.policies import PolicySpec, make_policy, parse_policy_list
from testbed.scenario import Scenario
from testbed.traces.workload import Workload

REPORT_P50_GAP_S = 2.5  # the PDD report (docs/design.md): decode in another city adds +2.5 s to P50 TTFT
REPORT_SLA_GAIN = 0.278  # PDD's SLA-compliant throughput over the same-dc baseline
SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class Draw:
    """One repetition: the recipe's seed and the workload it gives (selected as the user asked)."""

    seed: int
    workload: Workload

    @property
    def tag(self) -> str:
        return f"seed-{self.seed}"


def parse_range(text: str, what: str) -> list[float]:
    """``A:B:STEP`` -> [A, A+STEP, ..., B] (B included when it lies on the grid)."""
    try:
        lo, hi, step = (float(x) for x in text.split(":"))
    except ValueError as e:
        raise InputError(f"{what}: expected A:B:STEP, got {text!r}") from e
    if step <= 0 or hi < lo or lo < 0:
        raise InputError(f"{what}: expected 0 <= A <= B and STEP > 0, got {text!r}")
    n = int(math.floor((hi - lo) / step + 1e-9)) + 1
    if n > 200:
        raise InputError(f"{what}: {n} points; at most 200")
    return [round(lo + i * step, 10) for i in range(n)]


class LoadPoint(BaseModel):
    """One policy's measured summary at one offered load (emulated seconds)."""

    model_config = ConfigDict(extra="forbid")

    load: float  # x the trace's own arrival rate
    policy: str
    run_dir: str
    requests: int
    completed: int
    failed: int
    rps: float | None  # requests / emulated span of the replay (first sent to last token)
    slo_attainment: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    fidelity_passed: bool
    egress_per_h: float | None = None  # the WAN's KV priced (costs.wan_egress_per_gb), per emulated hour

    @classmethod
    def of(cls, load: float, policy: str, s: PolicySummary, run_dir: Path) -> LoadPoint:
        rps = s.requests / s.duration_s if s.duration_s else None
        return cls(load=load, policy=policy, run_dir=str(run_dir), requests=s.requests, completed=s.completed,
                   failed=s.failed, rps=rps, slo_attainment=s.slo_attainment, ttft_p50_s=s.ttft_p50_s,
                   ttft_p90_s=s.ttft_p90_s, ttft_p99_s=s.ttft_p99_s, tpot_p50_s=s.tpot_p50_s,
                   fidelity_passed=s.fidelity.passed,
                   egress_per_h=s.egress * 3600 / s.duration_s if s.egress is not None and s.duration_s else None)

    def meets(self, share: float) -> bool:
        return self.slo_attainment is not None and self.slo_attainment >= share


class SlaThroughput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str
    share: float
    load: float | None  # None: not even the lowest load met the objectives
    rps: float | None
    cost: float | None = None  # the deployment's price (scenario costs), None without prices
    bcr: float | None = None  # SLA throughput per price
    egress_per_h: float | None = None  # at the SLA point: its WAN KV priced, per hour
    bcr_with_egress: float | None = None  # SLA throughput per (price + egress per hour)


class SweepResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dilation: float
    slo_ttft_s: float
    slo_tpot_s: float
    share: float
    points: list[LoadPoint]
    sla: list[SlaThroughput]


def sla_throughput(points: list[LoadPoint], policy: str, share: float) -> SlaThroughput:
    """The highest load below the first one that misses the objectives."""
    best: LoadPoint | None = None
    for p in sorted((p for p in points if p.policy == policy), key=lambda p: p.load):
        if not p.meets(share):
            break
        best = p
    return SlaThroughput(policy=policy, share=share, load=best.load if best else None,
                         rps=best.rps if best else None, egress_per_h=best.egress_per_h if best else None)


@dataclass
class Bisection:
    steps: list[tuple[float, float]]  # (x, response) in the order evaluated
    load: float  # the x settled on (a load, or what else was bisected)
    value: float
    reached: bool  # False: the target lies outside the range; load/value are the closest seen


def bisect(f: Callable[[Sequence[float]], list[float]], target: float, lo: float, hi: float, tol: float,
           max_steps: int = 8, increasing: bool | None = True) -> Bisection:
    """The ``x`` in [lo, hi] with ``f(x)`` within ``tol`` of ``target`` for a monotone ``f``
    (noise allowed: the bracket follows each measurement). Midpoints are geometric: load
    spans orders of magnitude. ``f`` takes several points at once: the range's two ends are
    evaluated together (side by side in the simulator); ``increasing=None`` reads the
    direction from them. ``max_steps`` counts evaluations, the two ends included. When both
    ends lie on one side of the target it gives the closest instead (``reached`` False)."""
    if not 0 < lo < hi:
        raise InputError(f"range: expected 0 < low < high, got {lo:g}:{hi:g}")
    f_lo, f_hi = f([lo, hi])
    steps = [(lo, f_lo), (hi, f_hi)]

    def closest(reached: bool) -> Bisection:
        x, v = min(steps, key=lambda s: abs(s[1] - target))
        return Bisection(steps, x, v, reached and abs(v - target) <= tol)

    sign = 1.0 if (f_hi >= f_lo if increasing is None else increasing) else -1.0
    if min(abs(f_lo - target), abs(f_hi - target)) <= tol:
        return closest(True)
    if sign * (f_lo - target) > 0 or sign * (f_hi - target) < 0:
        return closest(False)
    a, b = lo, hi
    while len(steps) < max_steps and b / a > 1.02:
        mid = math.sqrt(a * b)
        steps.append((mid, f([mid])[0]))
        if abs(steps[-1][1] - target) <= tol:
            break
        a, b = (mid, b) if sign * (steps[-1][1] - target) < 0 else (a, mid)
    return closest(True)


def bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float, tol: float,
                      max_steps: int = 8) -> Bisection:
    """``bisect`` of an increasing ``f`` evaluated one point at a time."""
    return bisect(lambda xs: [f(x) for x in xs], target, lo, hi, tol, max_steps)


@dataclass(frozen=True)
class SweepOptions:
    run: RunOptions  # speed and out are set per point
    out: Path
    share: float = 0.9  # of requests meeting both objectives


def fixed_dilation(sc: Scenario, wl: Workload, opts: RunOptions) -> RunOptions:
    """One dilation for every point (``auto`` calibrated once, on the trace at its own rate;
    the simulator's is 1)."""
    if kind(opts.engine).virtual_time:
        return dataclasses.replace(opts, dilation=1.0)
    if opts.executor == "ray":  # probed on a node, as the replays run there, not on the driver
        return dataclasses.replace(opts, dilation=dilation_on_a_node(sc, wl, opts))
    plan = emulation_plan(sc, wl, wl.specs(1.0), opts.dilation, replay=probe_replay)
    return dataclasses.replace(opts, dilation=plan.dilation)


def run_point(sc: Scenario, wl: Workload, policies: list[PolicySpec], load: float, run: RunOptions,
              out: Path) -> list[LoadPoint]:
    """``testbed run`` at ``load`` into ``out/load-<load>``; its policies' points."""
    run_dir = out / f"load-{load:g}"
    print(f"\n== load {load:g} x the trace's rate -> {run_dir}", flush=True)
    run_trace(sc, wl, policies, dataclasses.replace(run, speed=load, out=run_dir, allow_infidelity=True))
    summary, _ = load_run(run_dir)
    return [LoadPoint.of(load, name, s, run_dir) for name, s in summary.policies.items()]


def load_sweep(sc: Scenario, wl: Workload, policies: list[PolicySpec], loads: list[float],
               opts: SweepOptions) -> SweepResult:
    run = fixed_dilation(sc, wl, opts.run)
    for load in loads:
        print(f"\n== load {load:g} x the trace's rate -> {opts.out / f'load-{load:g}'}", flush=True)
    run_all([Replay(sc, wl, policies, dataclasses.replace(run, speed=load, out=opts.out / f"load-{load:g}",
                                                          allow_infidelity=True)) for load in loads])
    points: list[LoadPoint] = []
    present = saved([opts.out / f"load-{load:g}" for load in loads])
    for load in loads:
        if (run_dir := opts.out / f"load-{load:g}") not in present:
            continue
        summary, _ = load_run(run_dir)
        points += [LoadPoint.of(load, name, s, run_dir) for name, s in summary.policies.items()]
    sla = []
    for spec in policies:
        t = sla_throughput(points, spec.label, opts.share)
        cost = hardware_cost(sc, make_policy(spec))
        if cost is not None:
            t.cost = cost.total
            t.bcr = t.rps / cost.total if t.rps is not None and cost.total else None
            with_egress = cost.total + (t.egress_per_h or 0.0)
            t.bcr_with_egress = t.rps / with_egress if t.rps is not None and with_egress else None
        sla.append(t)
    assert isinstance(run.dilation, float)
    result = SweepResult(dilation=run.dilation, slo_ttft_s=run.slo.ttft_s, slo_tpot_s=run.slo.tpot_s,
                         share=opts.share, points=points, sla=sla)
    save_sweep(result, opts.out)
    return result


def save_sweep(result: SweepResult, out: Path) -> list[Path]:
    import pandas as pd

    from testbed.analysis import plots

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / SWEEP_FILE, result.model_dump_json(indent=2))
    df = pd.DataFrame([p.model_dump() for p in result.points])
    write_csv(df, out / "sweep.csv")
    write_atomic(out / "sweep.md", sweep_markdown(result))
    plots.plot_sweep(df, out / "sweep.png", result.share)
    return [out / SWEEP_FILE, out / "sweep.csv", out / "sweep.md", out / "sweep.png"]


def _fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def sweep_markdown(r: SweepResult) -> str:
    lines = [f"# Load sweep (D = {r.dilation:g}; SLO: TTFT <= {r.slo_ttft_s:g} s and TPOT <= {r.slo_tpot_s:g} s "
             f"for {100 * r.share:.0f} % of requests)", "",
             *table_head(["load", "policy", "completed", "failed", "rps", "SLO met", "TTFT P50", "P90", "P99",
                          "fidelity"], "rlrrrrrrrl")]
    for p in sorted(r.points, key=lambda p: (p.load, p.policy)):
        met = _fmt(None if p.slo_attainment is None else 100 * p.slo_attainment, ".0f", " %")
        lines.append(f"| {p.load:g} | {p.policy} | {p.completed}/{p.requests} | {p.failed} | "
                     f"{_fmt(p.rps, '.3f')} | {met} | {_fmt(p.ttft_p50_s)} | {_fmt(p.ttft_p90_s)} | "
                     f"{_fmt(p.ttft_p99_s)} | {'ok' if p.fidelity_passed else 'FAILED'} |")
    lines += ["", "## SLA throughput", "",
              *table_head(["policy", "highest load meeting the SLO", "rps", "price", "BCR (rps per price)",
                           "egress per hour", "BCR with egress"], "lrrrrrr")]
    for t in r.sla:
        lines.append(f"| {t.policy} | {_fmt(t.load, 'g')} | {_fmt(t.rps, '.3f')} | {_fmt(t.cost)} | "
                     f"{_fmt(t.bcr, '.5f')} | {_fmt(t.egress_per_h, '.4f')} | {_fmt(t.bcr_with_egress, '.5f')} |")
    base = next((t for t in r.sla if t.policy.startswith("same-dc")), None)
    pdd = next((t for t in r.sla if t.policy.startswith("pdd")), None)
    if base and pdd and base.rps and pdd.rps is not None:
        gain = pdd.rps / base.rps - 1
        lines += ["", f"PDD's SLA throughput over same-dc: {100 * gain:+.1f} % (the report: "
                      f"+{100 * REPORT_SLA_GAIN:.1f} %); the step of the sweep bounds the precision."]
        if base.bcr and pdd.bcr is not None:
            lines.append(f"BCR over same-dc: {100 * (pdd.bcr / base.bcr - 1):+.1f} % (the report: up to +37.5 %).")
        if base.bcr_with_egress and pdd.bcr_with_egress is not None and (pdd.egress_per_h or base.egress_per_h):
            lines.append(f"With egress: {100 * (pdd.bcr_with_egress / base.bcr_with_egress - 1):+.1f} %.")
    caveat = unbounded(r)
    if caveat:
        lines += ["", caveat]
    return "\n".join(lines) + "\n"


def unbounded(r: SweepResult) -> str | None:
    """A warning when a policy met the objectives at the highest load swept: its SLA throughput
    is then a lower bound (the sweep never found its limit), and a gain is not a capacity gain
    but each policy's throughput at that load (with closed-loop sessions, how fast it answers)."""
    top = max((p.load for p in r.points), default=None)
    at_top = [t.policy for t in r.sla if t.load is not None and t.load == top]
    if not at_top:
        return None
    return (f"Lower bound: {', '.join(at_top)} met the objectives at the highest load swept ({top:g}x), so the sweep "
            "did not reach that limit; a gain here compares the throughput each policy achieved at that load, not "
            "capacity. Sweep higher loads to find it.")


def p50_gap(points: list[LoadPoint]) -> float:
    """cross-dc minus same-dc P50 TTFT among ``points`` (one load)."""
    by = {p.policy.split(":")[0]: p for p in points}
    same, cross = by.get("same-dc"), by.get("cross-dc")
    if same is None or cross is None or same.ttft_p50_s is None or cross.ttft_p50_s is None:
        raise InputError("calibration needs same-dc and cross-dc runs that completed requests")
    return cross.ttft_p50_s - same.ttft_p50_s


def calibrate(sc: Scenario, draws: list[Draw], policies: list[PolicySpec], lo: float, hi: float, tol_s: float,
              max_steps: int, opts: SweepOptions,
              final_draws: list[Draw] | None = None) -> tuple[Bisection, dict[float, list[float]], list[Path]]:
    """Bisect the load for cross-dc minus same-dc P50 TTFT = +2.5 s (same-dc and cross-dc
    only; over several draws of the trace, their mean gap), then run ``policies`` at the load
    found. Returns the bisection, every load's gap per draw, and the final run folder of
    each draw (``load-<x>/``, or ``seed-<s>/load-<x>/`` over several draws). ``final_draws``
    (more requests, more draws than the bisection needs): the policies run on those at the
    load found instead, in ``final/`` (on a draw the bisection replayed, only the policies it
    did not run)."""
    import statistics

    from testbed.analysis.report import merge_runs

    run = fixed_dilation(sc, draws[0].workload, opts.run)
    pair = parse_policy_list("same-dc,cross-dc")
    seen: dict[tuple[float, int], list[LoadPoint]] = {}
    gaps: dict[float, list[float]] = {}

    def where(d: Draw, part: str = "") -> Path:
        base = opts.out / part if part else opts.out
        return base / d.tag if len(draws) > 1 else base

    def gap(load: float) -> float:
        for d in draws:
            seen[load, d.seed] = run_point(sc, d.workload, pair, load, run, where(d, "bisection"))
            gaps.setdefault(load, []).append(p50_gap(seen[load, d.seed]))
        g = statistics.fmean(gaps[load])
        print(f"== load {load:g}: cross-dc minus same-dc P50 TTFT {g:+.2f} s"
              f"{f' (mean of {len(draws)} draws)' if len(draws) > 1 else ''} (target +{REPORT_P50_GAP_S:g})",
              flush=True)
        return g

    b = bisect_increasing(gap, REPORT_P50_GAP_S, lo, hi, tol_s, max_steps)
    finals = []
    for d in final_draws if final_draws is not None else draws:
        final_dir, same = where(d), True
        if final_draws is not None:
            final_dir = opts.out / "final" / d.tag if len(final_draws) > 1 else opts.out / "final"
            replayed = next((x.workload for x in draws if x.seed == d.seed), None)
            same = replayed is not None and [r.rid for r in replayed.requests] == [r.rid for r in d.workload.requests]
        if not same:  # requests the bisection did not replay: every policy runs
            run_point(sc, d.workload, policies, b.load, run, final_dir)
            finals.append(final_dir / f"load-{b.load:g}")
            continue
        # The baselines already ran on these requests at that load; only the other policies
        # run again, and the point's folder holds them all.
        done = seen[b.load, d.seed]
        dirs = [Path(done[0].run_dir)]
        rest = [p for p in policies if p.label not in {pt.policy for pt in done}]
        if rest:
            run_point(sc, d.workload, rest, b.load, run, where(d, "rest"))
            dirs.append(where(d, "rest") / f"load-{b.load:g}")
        merge_runs(dirs, final_dir / f"load-{b.load:g}")
        finals.append(final_dir / f"load-{b.load:g}")
    return b, gaps, finals
