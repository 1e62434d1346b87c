"""The report's regime: two unknowns fitted to two of its figures at once.

The report states neither its offered load nor what its prefill costs: the cost per token
of the model it served (its ~50 KB of KV per token fixes an attention shape, not a model
size) and how its baseline splits 88 accelerators between prefill and decode. Fitting the
load alone to the +2.5 s gap leaves the baseline far from queueing (same-dc P50 0.05 s
against the report's 4.2 s). ``testbed calibrate --fit load,prefill`` fits two:

* the **load** (x the trace's rate) so that same-dc's TTFT P50 is the report's 4.2 s, for a
  given prefill cost: same-dc's P50 grows with the load (bisected, ``bisect``);
* the **prefill cost** (x the FLOPs' time, ``Scenario.with_prefill_cost``) so that
  cross-dc's TTFT P50 at that load is the report's 6.7 s. A costlier prefill queues to 4.2 s
  at a lower load, so less KV crosses the line and the gap shrinks: cross-dc's P50 at the
  fitted load is monotone in the cost, its direction read from the range's two ends
  (``bisect`` with ``increasing=None``). Decode keeps its cost: scaling the whole model's
  instead (tried first) made cross-dc's eight-fold fewer-FLOPS decoders (H20) the queue at
  the factors that made same-dc queue, and no factor reached both targets.

Every evaluation is one policy's replay of the whole selection (>= 1,000 requests of the
report's trace in ``make reproduce``), saved under ``bisection/prefill-<c>/load-<x>/``; a
second fit into the same folder keeps them (``--resume`` is implied there). Then every policy
runs at the point found over the final draws (``final/``): the figures the fit did not
touch are the predictions, each with its 95 % interval over the draws.

**What if** (``--whatif-shares``): the fitted factor stands for a costlier prefill or a
baseline with fewer prefill accelerators, and the two differ for PDD, whose own prefill
keeps the scenario's accelerators. For a baseline that gives prefill ``s`` of its
accelerators (the scenario gives ``P``), the same queue means a model ``c x s / P`` as
costly as the scenario prices it: PDD replays at that cost over the final draws (folders
``whatif/share-<s>/``), and its TTFT is compared, draw by draw, with same-dc's at the point.

Saved: ``regime.json`` (``RegimeFit``), ``regime.md``; ``testbed report DIR`` rebuilds the
table. The Makefile's ``reproduce`` reads ``load`` and ``prefill_cost`` from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from testbed.analysis.confidence import mean_ci
from testbed.analysis.report import repetitions_markdown
from testbed.analysis.results import load_run
from testbed.analysis.tables import table_head
from testbed.errors import InputError
from testbed.experiments.load_sweep import Bisection, Draw, bisect, fixed_dilation
from testbed.experiments.parallel import Replay, run_all
from testbed.experiments.trace_run import RunOptions
from testbed.outputs import write_atomic
from testbed.policies import PolicySpec, parse_policy_list
from testbed.scenario import Role, Scenario

REPORT_SAME_P50_S = 4.2  # the report's same-datacenter TTFT P50 (docs/design.md)
REPORT_CROSS_P50_S = 6.7  # and with decode in another city (+2.5 s)
REGIME_FILE = "regime.json"


class Probe(BaseModel):
    """One evaluation of the search: a policy's TTFT P50 at one (prefill cost, load)."""

    model_config = ConfigDict(extra="forbid")

    prefill_cost: float
    load: float
    policy: str
    p50_s: float
    run_dir: str


class WhatIf(BaseModel):
    """PDD against same-dc when the baseline prefills on ``share`` accelerators: mean, P50 and
    P99 TTFT relative to same-dc's at the fitted point (mean and 95 % half-width over draws)."""

    model_config = ConfigDict(extra="forbid")

    share: int
    pdd_prefill_cost: float
    runs: list[str]
    # "mean"|"p50"|"p99" -> (mean, half-width) of PDD / same-dc - 1; (None, None) where no draw measured it
    vs_same: dict[str, tuple[float | None, float | None]]


class RegimeFit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    load_range: tuple[float, float]
    prefill_cost_range: tuple[float, float]
    tolerance_s: tuple[float, float]  # same-dc's, cross-dc's
    requests: int  # per evaluation
    probes: list[Probe]  # the search path, in order
    load: float
    prefill_cost: float
    same_p50_s: float
    cross_p50_s: float
    reached: bool
    finals: list[str] = []  # every policy at the point, one folder per final draw
    final_requests: int = 0
    prefill_accelerators: int = 0  # the scenario's, which same-dc and PDD share (what-if)
    whatif: list[WhatIf] = []


def fit_two(p50: Callable[[str, Sequence[tuple[float, float]]], list[float]], load_range: tuple[float, float],
            cost_range: tuple[float, float], tol: tuple[float, float], load_steps: int,
            cost_steps: int) -> tuple[float, float, float, float, bool]:
    """(load, cost, same-dc P50, cross-dc P50, reached): for each cost tried, the load where
    same-dc's P50 is 4.2 s; the cost where cross-dc's P50 there is 6.7 s.
    ``p50(policy, [(cost, load), ...])`` replays a policy at those points."""
    inner: dict[float, tuple[Bisection, float]] = {}

    def cross_at(costs: Sequence[float]) -> list[float]:
        founds = []
        for c in costs:  # each search's two ends replay together (in parallel in the simulator)
            founds.append(bisect(lambda xs, c=c: p50("same-dc", [(c, x) for x in xs]), REPORT_SAME_P50_S,
                                 *load_range, tol[0], load_steps))
        crosses = p50("cross-dc", [(c, fd.load) for c, fd in zip(costs, founds, strict=True)])
        for c, fd, v in zip(costs, founds, crosses, strict=True):
            inner[c] = (fd, v)
            print(f"== prefill cost x{c:.3g}: same-dc P50 {fd.value:.2f} s at load {fd.load:.3g}"
                  f"{'' if fd.reached else ' (4.2 s not reached in the load range)'}; cross-dc P50 {v:.2f} s "
                  f"(target {REPORT_CROSS_P50_S:g})", flush=True)
        return crosses

    outer = bisect(cross_at, REPORT_CROSS_P50_S, *cost_range, tol[1], cost_steps, increasing=None)
    fd, cross = inner[outer.load]
    return fd.load, outer.load, fd.value, cross, outer.reached and fd.reached


def fit_regime(sc: Scenario, draw: Draw, policies: list[PolicySpec], final_draws: list[Draw], opts: RunOptions,
               out: Path, load_range: tuple[float, float], cost_range: tuple[float, float],
               tol: tuple[float, float], load_steps: int, cost_steps: int) -> RegimeFit:
    """The search on ``draw``, then every policy at the point found over ``final_draws``."""
    run = dataclasses.replace(fixed_dilation(sc, draw.workload, opts), allow_infidelity=True)
    probes: list[Probe] = []
    scaled: dict[float, Scenario] = {}

    def scenario(c: float) -> Scenario:
        return scaled.setdefault(c, sc.with_prefill_cost(c))

    def p50(policy: str, points: Sequence[tuple[float, float]]) -> list[float]:
        spec = parse_policy_list(policy)
        dirs = [out / "bisection" / f"prefill-{c:.4g}" / f"load-{x:.4g}" for c, x in points]
        # The same-dc replay of a point stays when cross-dc joins it (resume), and so does
        # every replay of an interrupted fit.
        run_all([Replay(scenario(c), draw.workload, spec, dataclasses.replace(run, speed=x, out=d, resume=True))
                 for (c, x), d in zip(points, dirs, strict=True)])
        values = []
        for (c, x), d in zip(points, dirs, strict=True):
            s = load_run(d)[0].policies[spec[0].label]
            if s.ttft_p50_s is None:
                raise InputError(f"{d}: {policy} completed no request at prefill cost x{c:g}, load {x:g}")
            probes.append(Probe(prefill_cost=c, load=x, policy=policy, p50_s=s.ttft_p50_s, run_dir=str(d)))
            values.append(s.ttft_p50_s)
        return values

    load, cost, same, cross, reached = fit_two(p50, load_range, cost_range, tol, load_steps, cost_steps)
    fit = RegimeFit(load_range=load_range, prefill_cost_range=cost_range, tolerance_s=tol,
                    requests=len(draw.workload.requests), probes=probes, load=load, prefill_cost=cost,
                    same_p50_s=same, cross_p50_s=cross, reached=reached)
    save_regime(fit, out)  # the search is kept before the finals run
    many = len(final_draws) > 1
    finals = [out / "final" / (d.tag if many else "") / f"load-{load:.4g}" for d in final_draws]
    run_all([Replay(scenario(cost), d.workload, policies, dataclasses.replace(run, speed=load, out=f, resume=True))
             for d, f in zip(final_draws, finals, strict=True)])
    fit = fit.model_copy(update={"finals": [str(f) for f in finals],
                                 "final_requests": len(final_draws[0].workload.requests)})
    save_regime(fit, out)
    return fit


WHATIF_STATS = {"mean": "ttft_mean_s", "p50": "ttft_p50_s", "p99": "ttft_p99_s"}


def prefill_accelerators(sc: Scenario) -> int:
    """The accelerators of every prefill instance: what the baseline and PDD prefill on."""
    return sum(sc.host(h).devices for h in sc.hosts_with_role(Role.PREFILL))


def whatif_shares(sc: Scenario, fit: RegimeFit, final_draws: list[Draw], opts: RunOptions, out: Path,
                  shares: Sequence[int]) -> RegimeFit:
    """PDD at the prefill cost a baseline of each prefill share implies (module docstring),
    over the final draws, against same-dc's finals draw by draw."""
    total = prefill_accelerators(sc)
    if not fit.finals or "same-dc" not in load_run(Path(fit.finals[0]))[0].policies:
        raise InputError("--whatif-shares compares PDD with same-dc at the fitted point: include same-dc in --policies")
    if "pdd" not in load_run(Path(fit.finals[0]))[0].policies:
        raise InputError("--whatif-shares replays PDD and reads its finals: include pdd in --policies")
    bad = [x for x in shares if x <= 0]
    if bad:
        raise InputError(f"--whatif-shares: a share is a positive number of accelerators, got {bad[0]}")
    run = dataclasses.replace(fixed_dilation(sc, final_draws[0].workload, opts), allow_infidelity=True)
    pdd = parse_policy_list("pdd")
    many = len(final_draws) > 1
    plans = [(x, fit.prefill_cost * x / total) for x in shares]
    try:
        scaled = {x: sc.with_prefill_cost(c) for x, c in plans if x != total}
    except ValueError as e:
        raise InputError(f"--whatif-shares: {e}") from None
    # The scenario's own share is the point itself: its PDD is the finals' (no replay).
    dirs = {x: [Path(f) for f in fit.finals] if x == total else
            [out / "whatif" / f"share-{x}" / (d.tag if many else "") for d in final_draws] for x, _ in plans}
    run_all([Replay(scaled[x], d.workload, pdd, dataclasses.replace(run, speed=fit.load, out=f, resume=True))
             for x, _ in plans if x != total for d, f in zip(final_draws, dirs[x], strict=True)])
    same = [load_run(Path(f))[0].policies["same-dc"] for f in fit.finals]
    found = []
    for x, c in plans:
        mine = [load_run(f)[0].policies["pdd"] for f in dirs[x]]
        vs = {}
        for key, field in WHATIF_STATS.items():
            ratios = [getattr(p, field) / getattr(b, field) - 1 for p, b in zip(mine, same, strict=True)
                      if getattr(p, field) and getattr(b, field)]
            ci = mean_ci(ratios)
            vs[key] = (ci.mean, ci.half) if ci else (None, None)
        found.append(WhatIf(share=x, pdd_prefill_cost=c, runs=[str(f) for f in dirs[x]], vs_same=vs))
    fit = fit.model_copy(update={"prefill_accelerators": total, "whatif": found})
    save_regime(fit, out)
    return fit


def whatif_markdown(f: RegimeFit) -> list[str]:
    if not f.whatif:
        return []

    def pct(v: tuple[float | None, float | None]) -> str:
        if v[0] is None:
            return "-"
        return f"{100 * v[0]:+.1f} %" + ("" if v[1] is None else f" ± {100 * v[1]:.1f}")

    lines = ["", "## What the baseline's prefill share would make true", "",
             f"The fitted x{f.prefill_cost:.3g} stands for a prefill that costly on the scenario's "
             f"{f.prefill_accelerators} prefill accelerators, or a model x{f.prefill_cost:.3g} x s / "
             f"{f.prefill_accelerators} as costly on a baseline prefilling on s of them: same-dc's queue is the "
             f"same. PDD keeps its {f.prefill_accelerators}, so its prefill is that cheaper model's (same-dc as "
             f"fitted; mean and 95 % interval over the draws, each PDD draw against same-dc's):", "",
             *table_head(["baseline's prefill accelerators", "PDD's prefill cost", "PDD mean TTFT vs same-dc",
                          "P50", "P99"], "rrrrr")]
    for w in f.whatif:
        lines.append(f"| {w.share} | x{w.pdd_prefill_cost:.3g} | {pct(w.vs_same['mean'])} | "
                     f"{pct(w.vs_same['p50'])} | {pct(w.vs_same['p99'])} |")
    return lines


def regime_markdown(f: RegimeFit) -> str:
    lines = ["# Calibration of two unknowns: the load and the prefill's cost per token", "",
             f"Targets: same-dc TTFT P50 = {REPORT_SAME_P50_S:g} s (± {f.tolerance_s[0]:g}) and cross-dc TTFT P50 = "
             f"{REPORT_CROSS_P50_S:g} s (± {f.tolerance_s[1]:g}), the report's. For each prefill cost tried "
             f"(range x{f.prefill_cost_range[0]:g}-x{f.prefill_cost_range[1]:g}), the load (range {f.load_range[0]:g}-"
             f"{f.load_range[1]:g} x the trace's rate) is bisected for same-dc's P50; the cost is bisected for "
             f"cross-dc's P50 at that load. {f.requests} requests per evaluation. The search path:", "",
             *table_head(["#", "prefill cost", "load", "policy", "TTFT P50"], "rrrlr")]
    for i, p in enumerate(f.probes, 1):
        lines.append(f"| {i} | x{p.prefill_cost:.3g} | {p.load:.3g} | {p.policy} | {p.p50_s:.2f} s |")
    verdict = "Fitted" if f.reached else "NOT REACHED (the closest point, used below)"
    lines += ["", f"{verdict}: load {f.load:.4g} x the trace's rate, prefill cost x{f.prefill_cost:.4g} "
                  f"(same-dc P50 {f.same_p50_s:.2f} s, cross-dc P50 {f.cross_p50_s:.2f} s)."]
    if f.finals:
        runs = [(Path(d), load_run(Path(d))[0]) for d in f.finals]
        lines += ["", f"## Every policy at that point, over {len(runs)} draw(s) of {f.final_requests} requests", "",
                  "Everything but the two P50s is a prediction: nothing else was fitted.", "",
                  repetitions_markdown(runs).split("\n", 1)[1].strip()]
    lines += whatif_markdown(f)
    return "\n".join(lines) + "\n"


def save_regime(f: RegimeFit, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / REGIME_FILE, f.model_dump_json(indent=2))
    write_atomic(out / "regime.md", regime_markdown(f))
    return [out / REGIME_FILE, out / "regime.md"]
