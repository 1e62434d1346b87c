"""``testbed validate``: the same replay in both engines, figure by figure, with a verdict.

The simulator runs the deployment's code with a modeled network and no host; the emulation
runs it as processes moving real bytes. ``validate`` replays one scenario, trace, load and
fault timeline in each (``emulation/`` and ``sim/``, two ordinary run folders) and compares
every policy's figures against the tolerances below: a figure within its tolerance passes;
one that misses is printed as such (``docs/simulation.md`` says what each miss was traced
to). Beside the percentiles, the distance between the two TTFT distributions
(Wasserstein-1, as a share of the emulation's mean TTFT) says how alike the whole
distributions are. Saved: ``validation.md`` and ``validation.json``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict
from scipy.stats import wasserstein_distance

from testbed.analysis.results import SUMMARY_FILE, PolicySummary, load_run
from testbed.experiments.parallel import Replay, run_all
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.outputs import new_run_dir, write_atomic
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import Workload

VALIDATION_FILE = "validation.json"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    relative: float | None = None  # |sim - emulation| <= relative x |emulation|
    points: float | None = None  # |sim - emulation| <= points (percentage points of a share)
    equal: bool = False


TOLERANCES: dict[str, Tolerance] = {
    "TTFT P50 s": Tolerance(relative=0.10),
    "TTFT P90 s": Tolerance(relative=0.10),
    "TTFT P99 s": Tolerance(relative=0.15),
    "TPOT P50 s": Tolerance(relative=0.05),
    "TPOT P99 s": Tolerance(relative=0.05),
    "WAN KV MB": Tolerance(relative=0.02),
    "KV transfer P50 s": Tolerance(relative=0.15),
    "KV transfer P99 s": Tolerance(relative=0.15),
    "RLD share %": Tolerance(points=2.0),
    "handoffs": Tolerance(relative=0.10),
    "cut-offs": Tolerance(relative=0.10),
    "SLO met %": Tolerance(points=3.0),
    "failed": Tolerance(equal=True),
}
PIPELINE = Tolerance(relative=0.10)  # each pipeline's count of requests


class Figure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str
    figure: str
    emulation: float | None
    sim: float | None
    tolerance: str
    passed: bool | None  # None: reported only (or not judged: see ``judged``)
    judged: bool = True  # False: the emulation's fidelity verdict failed, its figures measure the host

    @property
    def difference(self) -> str:
        if self.emulation is None or self.sim is None:
            return "-"
        d = self.sim - self.emulation
        if self.emulation and "%" not in self.figure and self.figure != "failed":
            return f"{d:+.3g} ({100 * d / abs(self.emulation):+.1f} %)"
        return f"{d:+.3g}"


class ValidationResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: str
    trace: str
    requests: int
    figures: list[Figure]

    unjudged: list[str] = []  # policies whose emulation failed its fidelity verdict: shown, not judged

    @property
    def passed(self) -> bool:
        return all(f.passed is not False for f in self.figures)

    @property
    def misses(self) -> list[Figure]:
        return [f for f in self.figures if f.passed is False]


def judge_figure(policy: str, name: str, emulation: float | None, sim: float | None, tol: Tolerance) -> Figure:
    emulation, sim = (None if x is None or math.isnan(x) else x for x in (emulation, sim))
    if emulation is None or sim is None:  # measured by one engine only: a miss; by neither: nothing
        passed = None if emulation is None and sim is None else False
        return Figure(policy=policy, figure=name, emulation=emulation, sim=sim, tolerance=_describe(tol),
                      passed=passed)
    d = abs(sim - emulation)
    if tol.equal:
        ok = d == 0
    elif tol.points is not None:
        ok = d <= tol.points
    else:
        assert tol.relative is not None
        ok = d <= tol.relative * abs(emulation)
    return Figure(policy=policy, figure=name, emulation=emulation, sim=sim, tolerance=_describe(tol), passed=ok)


def _describe(tol: Tolerance) -> str:
    if tol.equal:
        return "equal"
    if tol.points is not None:
        return f"+-{tol.points:g} points"
    return f"+-{100 * (tol.relative or 0):g} %"


def _q(s: pd.Series, q: float) -> float | None:
    s = s.dropna()
    return float(s.quantile(q)) if len(s) else None


def policy_figures(name: str, e: PolicySummary, s: PolicySummary, e_rows: pd.DataFrame,
                   s_rows: pd.DataFrame) -> list[Figure]:
    """Every compared figure of one policy."""
    def pct(x: float | None) -> float | None:
        return None if x is None else 100 * x

    values: dict[str, tuple[float | None, float | None]] = {
        "TTFT P50 s": (e.ttft_p50_s, s.ttft_p50_s),
        "TTFT P90 s": (e.ttft_p90_s, s.ttft_p90_s),
        "TTFT P99 s": (e.ttft_p99_s, s.ttft_p99_s),
        "TPOT P50 s": (e.tpot_p50_s, s.tpot_p50_s),
        "TPOT P99 s": (e.tpot_p99_s, s.tpot_p99_s),
        "WAN KV MB": (e.wan_kv_bytes / 1e6, s.wan_kv_bytes / 1e6),
        "KV transfer P50 s": (_q(e_rows.wan_transfer_s, 0.5), _q(s_rows.wan_transfer_s, 0.5)),
        "KV transfer P99 s": (_q(e_rows.wan_transfer_s, 0.99), _q(s_rows.wan_transfer_s, 0.99)),
        "RLD share %": (pct(e.rld_share), pct(s.rld_share)),
        "handoffs": (float(e.handoffs), float(s.handoffs)),
        "cut-offs": (float(e.wan_cut_offs), float(s.wan_cut_offs)),
        "SLO met %": (pct(e.slo_attainment), pct(s.slo_attainment)),
        "failed": (float(e.failed), float(s.failed)),
    }
    out = [judge_figure(name, k, a, b, TOLERANCES[k]) for k, (a, b) in values.items()]
    for pipeline in sorted(set(e.pipelines) | set(s.pipelines)):
        out.append(judge_figure(name, f"pipeline {pipeline}", float(e.pipelines.get(pipeline, 0)),
                                float(s.pipelines.get(pipeline, 0)), PIPELINE))
    te, ts = e_rows.ttft_s.dropna(), s_rows.ttft_s.dropna()
    if len(te) and len(ts) and te.mean() > 0:
        w1 = wasserstein_distance(te, ts) / te.mean()
        out.append(Figure(policy=name, figure="TTFT W1 / emulation's mean", emulation=None, sim=round(w1, 4),
                          tolerance="reported", passed=None))
    return out


def compare(emulation_dir: Path, sim_dir: Path) -> ValidationResult:
    """Two saved runs of the same replay, one per engine, figure by figure."""
    e_sum, e_df = load_run(emulation_dir)
    s_sum, s_df = load_run(sim_dir)
    figures: list[Figure] = []
    unjudged: list[str] = []
    for name, e in e_sum.policies.items():
        s = s_sum.policies.get(name)
        if s is None:
            continue
        these = policy_figures(name, e, s, e_df[e_df.policy == name], s_df[s_df.policy == name])
        if not e.fidelity.passed:  # shown beside the simulator's, marked, and not held against it
            unjudged.append(name)
            these = [f.model_copy(update={"passed": None, "judged": False}) for f in these]
        figures += these
    return ValidationResult(scenario=e_sum.scenario.name, trace=e_sum.trace.trace, requests=e_sum.trace.requests,
                            figures=figures, unjudged=unjudged)


def format_result(r: ValidationResult) -> str:
    lines = [f"# Validation: simulator vs emulation ({r.scenario}, {r.trace}, {r.requests} requests in the trace)",
             "", "| policy | figure | emulation | simulator | difference | tolerance | verdict |",
             "|---|---|---:|---:|---:|---|---|"]
    for f in r.figures:
        verdict = {True: "pass", False: "**MISS**", None: "-"}[f.passed] if f.judged else "not judged (fidelity)"
        lines.append(f"| {f.policy} | {f.figure} | {_num(f.emulation)} | {_num(f.sim)} | {f.difference} | "
                     f"{f.tolerance} | {verdict} |")
    n = sum(f.passed is not None for f in r.figures)
    lines += ["", f"{n - len(r.misses)} of {n} figures within tolerance"
              + ("" if r.passed else ": misses " + ", ".join(f"{f.policy} {f.figure}" for f in r.misses))]
    if r.unjudged:
        lines.append(f"not judged: {', '.join(r.unjudged)} (the emulation's fidelity verdict failed: its figures "
                     "measure this host; they are shown for reference)")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def validate(sc: Scenario, wl: Workload, policies: list[PolicySpec], opts: RunOptions, out: Path) -> int:
    """Both engines on the same replay, then the comparison of every policy. Exit: 1 when a
    judged figure misses its tolerance; else 3 when a policy's emulation failed its fidelity
    verdict (its figures are shown, marked, not judged: they measure the host); else 0. A
    finished emulation is always compared, whatever its verdict."""
    emulation = dataclasses.replace(opts, engine="emulation", out=out / "emulation")
    sim = dataclasses.replace(opts, engine="sim", dilation=None, out=out / "sim")
    if opts.executor == "ray":  # both engines side by side, the emulation on a host of its own
        code = run_all([Replay(sc, wl, policies, emulation), Replay(sc, wl, policies, sim)])[0]
    else:
        print("== the emulation", flush=True)
        code = run_trace(sc, wl, policies, emulation)
    if code == 3:
        print("validate: a policy's emulation failed its fidelity verdict; its figures are shown, not judged",
              flush=True)
    if opts.executor != "ray":
        print("\n== the simulator", flush=True)
        run_trace(sc, wl, policies, sim)
    if not all((o.out / SUMMARY_FILE).exists() for o in (emulation, sim) if o.out is not None):
        print("validate: a replay never came back from the cluster; nothing to compare", file=sys.stderr, flush=True)
        return 1
    result = compare(out / "emulation", out / "sim")
    text = format_result(result)
    write_atomic(out / "validation.md", text + "\n")
    write_atomic(out / VALIDATION_FILE, result.model_dump_json(indent=2))
    print("\n" + text, flush=True)
    print(f"saved: {out / 'validation.md'}, {out / VALIDATION_FILE}", flush=True)
    return 1 if not result.passed else 3 if result.unjudged else 0


def run_with_prediction(sc: Scenario, wl: Workload, policies: list[PolicySpec], opts: RunOptions) -> int:
    """``testbed run --with-sim``: the simulator's prediction of this very replay first (seconds,
    in ``sim/`` of the run's folder), then the emulation as ``run`` does, then the two side by
    side with ``validate``'s tolerances (``validation.md``). The exit status is the
    emulation's: a prediction that misses is reported, not an error of the run."""
    out = opts.out or new_run_dir("")
    print("== THE SIMULATOR's prediction of this replay (the same code in virtual time; the emulation follows)",
          flush=True)
    run_trace(sc, wl, policies, dataclasses.replace(opts, engine="sim", dilation=None, out=out / "sim"))
    print("\n== the emulation", flush=True)
    rc = run_trace(sc, wl, policies, dataclasses.replace(opts, out=out))
    if not (out / SUMMARY_FILE).exists():
        return rc
    result = compare(out, out / "sim")
    text = format_result(result)
    write_atomic(out / "validation.md", text + "\n")
    write_atomic(out / VALIDATION_FILE, result.model_dump_json(indent=2))
    print("\n== the simulator's prediction beside the emulation (testbed validate's tolerances; "
          "docs/simulation.md says what a miss was traced to)\n" + text, flush=True)
    return rc
