"""``testbed tune``: search a policy's knobs for the most SLA goodput per price.

A *trial* is one ``testbed run`` of the policy with one setting of its knobs, at a fixed
dilation and load, into ``trial-NNN/`` (a run folder: ``testbed report`` rebuilds it). Its
figures: goodput (requests meeting both objectives per emulated second), the price of the
deployment per hour with the egress of the KV it sent over the line (``costs``; 1 when the
scenario states no prices, so the search is then on goodput alone), and P99 TTFT.

The search is Optuna's TPE sampler on two objectives, goodput per price (up) and P99 TTFT
(down), seeded, with the policy's defaults as the first trial: a few random trials, then
each next one where the model of the good trials so far expects better ones. The trials
no other trial beats on both objectives are the Pareto front. Then the defaults and the
best trial by goodput per price are replayed on ``seeds`` draws of the trace's recipe (the
first draw is the trace itself), for a mean and a 95 % interval of each figure: one trial
is one draw, and a knob that wins by less than the draws' spread has not won.

Saved: ``tune.json`` (every trial and the repeated points), ``tune.md`` (the front, the
repeated points), ``tune.png`` (goodput per price against P99 TTFT, the front marked).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from testbed.analysis.confidence import mean_ci
from testbed.analysis.cost import hardware_cost
from testbed.analysis.plots import plot_tune
from testbed.analysis.results import SUMMARY_FILE, PolicySummary, load_run
from testbed.analysis.tables import table_head
from testbed.errors import InputError, TestbedError
from testbed.experiments.load_sweep import Draw, fixed_dilation
from testbed.experiments.parallel import Replay, run_all
from testbed.experiments.ray_executor import FAILED_FILE
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.outputs import write_atomic
from testbed.policies import Policy, PolicySpec, make_policy, policy_class, spec_for
from testbed.scenario import Scenario
from testbed.traces.workload import Workload

Suggest = Callable[[Any], Any]  # an Optuna trial -> one knob's value


def search_space(cls: type[Policy], fixed: Iterable[str] = ()) -> dict[str, Suggest]:
    """A policy's knobs as ``tune`` searches them, read from its ``Options``: every literal
    and boolean, and every number with both bounds (``ge``/``gt`` and ``le``/``lt``, or a
    ``json_schema_extra={"tune": {"low": .., "high": .., "log": .., "step": ..}}`` hint);
    ``{"tune": False}`` and the options in ``fixed`` (given on the command line) stay put."""
    space: dict[str, Suggest] = {}
    for name, f in cls.Options.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        hint = extra.get("tune")
        if hint is False or name in fixed:
            continue
        hint = hint if isinstance(hint, dict) else {}
        ann = f.annotation
        if get_origin(ann) is Literal:
            choices = list(get_args(ann))
            space[name] = lambda t, n=name, c=choices: t.suggest_categorical(n, c)
        elif ann is bool:
            space[name] = lambda t, n=name: t.suggest_categorical(n, [True, False])
        elif ann in (int, float):
            low, high = hint.get("low"), hint.get("high")
            for m in f.metadata:  # annotated_types' Ge, Gt, Le, Lt
                low = next((getattr(m, a) for a in ("ge", "gt") if low is None and hasattr(m, a)), low)
                high = next((getattr(m, a) for a in ("le", "lt") if high is None and hasattr(m, a)), high)
            if low is None or high is None:
                continue
            if ann is int:
                space[name] = lambda t, n=name, lo=int(low), hi=int(high), h=hint: t.suggest_int(
                    n, lo, hi, log=bool(h.get("log")), step=int(h.get("step", 1)))
            else:
                space[name] = lambda t, n=name, lo=float(low), hi=float(high), h=hint: t.suggest_float(
                    n, lo, hi, log=bool(h.get("log")))
    return space


def defaults(cls: type[Policy], space: dict[str, Suggest]) -> dict[str, Any]:
    """Where the search starts: each knob at its default."""
    start = cls.Options()
    return {k: getattr(start, k) for k in space}


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    policy: PolicySpec  # its given options stay as given; the others are searched
    trials: int = 12
    seeds: int = 3  # draws at the defaults and at the best trial
    seed: int = 1  # the sampler's
    load: float = 1.0
    run: RunOptions = RunOptions()
    concurrent: int = 1  # trials at once (on a Ray cluster: ``--executor ray``)


class TrialPoint(BaseModel):
    number: int
    knobs: dict[str, Any]
    spec: str
    run_dir: str
    goodput_rps: float | None
    price_per_h: float
    goodput_per_price: float | None
    ttft_p99_s: float | None
    slo_attainment: float | None
    failed: int
    fidelity_passed: bool
    seed: int | None = None  # the draw (repeated points)


class TuneResult(BaseModel):
    policy: str
    load: float
    dilation: float
    slo_ttft_s: float
    slo_tpot_s: float
    trials: list[TrialPoint]
    front: list[int]  # trial numbers on the Pareto front
    best: int  # the trial with the most goodput per price
    repeated: dict[str, list[TrialPoint]]  # "defaults" / "best" -> one point per draw
    wall_s: float


def _point(sc: Scenario, spec: PolicySpec, number: int, knobs: dict[str, Any], run_dir: Path,
           seed: int | None = None) -> TrialPoint:
    summary, _ = load_run(run_dir)
    s: PolicySummary = next(iter(summary.policies.values()))
    cost = hardware_cost(sc, make_policy(spec))
    egress_h = s.egress * 3600 / s.duration_s if s.egress is not None and s.duration_s else 0.0
    price = cost.total + egress_h if cost is not None else 1.0
    good = s.goodput_rps
    return TrialPoint(number=number, knobs=knobs, spec=spec.label, run_dir=str(run_dir), goodput_rps=good,
                      price_per_h=price, goodput_per_price=None if good is None else good / price,
                      ttft_p99_s=s.ttft_p99_s, slo_attainment=s.slo_attainment, failed=s.failed,
                      fidelity_passed=s.fidelity.passed, seed=seed)


def tune(sc: Scenario, wl: Workload, draws: list[Draw], opts: TuneOptions, out: Path) -> TuneResult:
    import optuna  # late: the CLI starts without it

    cls = policy_class(opts.policy)
    space = search_space(cls, opts.policy.options)
    if not space:
        raise InputError(f"--policy: {opts.policy.label} has no knobs to tune (its Options have no literal, boolean "
                         "or bounded number left to search)")
    if opts.trials < 2 or opts.seeds < 1:
        raise InputError("--trials must be at least 2 and --seeds at least 1")

    def suggest(trial: Any) -> dict[str, Any]:
        return {k: draw(trial) for k, draw in space.items()}

    def to_spec(knobs: dict[str, Any]) -> PolicySpec:
        return spec_for(cls, {**opts.policy.options, **knobs}, opts.policy.source)

    t0 = time.monotonic()
    run = dataclasses.replace(fixed_dilation(sc, wl, opts.run), speed=opts.load, allow_infidelity=True)
    trials: list[TrialPoint] = []

    lock = threading.Lock()  # concurrent trials (threads waiting on the cluster) append and save here

    def replay(w: Workload, spec: PolicySpec, run_dir: Path) -> None:
        if run.executor == "ray":  # a task on the cluster; its folder comes back here
            run_all([Replay(sc, w, [spec], dataclasses.replace(run, out=run_dir))])
            if not (run_dir / SUMMARY_FILE).exists():
                raise optuna.TrialPruned(f"{run_dir.name}: the replay never came back (its {FAILED_FILE})")
        else:
            run_trace(sc, w, [spec], dataclasses.replace(run, out=run_dir))

    def objective(trial: Any) -> tuple[float, float]:
        knobs = suggest(trial)
        spec = to_spec(knobs)
        run_dir = out / f"trial-{trial.number:03d}"
        print(f"\n== tune: trial {trial.number + 1}/{opts.trials}: {spec.label} -> {run_dir}", flush=True)
        replay(wl, spec, run_dir)
        p = _point(sc, spec, trial.number, knobs, run_dir)
        with lock:
            trials.append(p)
            trials.sort(key=lambda t: t.number)  # concurrent trials end in any order
            _save_trials(out, trials)
        return (p.goodput_per_price or 0.0, p.ttft_p99_s if p.ttft_p99_s is not None else float("inf"))

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=opts.seed, n_startup_trials=max(2, opts.trials // 3))
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    study.enqueue_trial(defaults(cls, space))  # trial 0: where the policy starts
    # With n_jobs > 1 Optuna runs trials in threads, each asking the sampler when it starts:
    # at most ``concurrent`` replays are on the cluster at once.
    study.optimize(objective, n_trials=opts.trials, n_jobs=opts.concurrent)
    if not trials:
        raise TestbedError("tune: no trial came back")
    front = sorted(t.number for t in study.best_trials)
    by_number = {t.number: t for t in trials}
    best = max(trials, key=lambda p: (p.goodput_per_price or 0.0, -(p.ttft_p99_s or float("inf")))).number
    repeated: dict[str, list[TrialPoint]] = {}
    for name, number in (("defaults", 0), ("best", best)):
        if number not in by_number:
            continue  # the defaults' trial never came back from the cluster
        knobs = by_number[number].knobs
        spec = to_spec(knobs)
        points = [by_number[number].model_copy(update={"seed": draws[0].seed})]
        dirs = [out / f"{name}-{d.tag}" for d in draws[1:]]
        for d, run_dir in zip(draws[1:], dirs, strict=True):
            print(f"\n== tune: {name} ({spec.label}) on draw {d.tag} -> {run_dir}", flush=True)
        if run.executor == "ray":  # the draws side by side
            run_all([Replay(sc, d.workload, [spec], dataclasses.replace(run, out=f)) for d, f in zip(draws[1:], dirs,
                                                                                                  strict=True)])
        else:
            for d, run_dir in zip(draws[1:], dirs, strict=True):
                replay(d.workload, spec, run_dir)
        # A draw that never came back from the cluster is left out (the command named it missing).
        points += [_point(sc, spec, number, knobs, f, d.seed) for d, f in zip(draws[1:], dirs, strict=True)
                   if run.executor != "ray" or (f / SUMMARY_FILE).exists()]
        repeated[name] = points
    assert isinstance(run.dilation, float)
    result = TuneResult(policy=opts.policy.label, load=opts.load, dilation=run.dilation, slo_ttft_s=run.slo.ttft_s,
                        slo_tpot_s=run.slo.tpot_s, trials=trials, front=front, best=best, repeated=repeated,
                        wall_s=time.monotonic() - t0)
    save_tune(result, out)
    return result


def _save_trials(out: Path, trials: list[TrialPoint]) -> None:
    """The trials so far (a search stopped halfway keeps what it measured)."""
    write_atomic(out / "trials.json", json.dumps([t.model_dump() for t in trials], indent=2))


def _ci(points: list[TrialPoint], field: str, fmt: str, scale: float = 1.0) -> str:
    m = mean_ci([getattr(p, field) for p in points])
    return "-" if m is None else m.format(scale, fmt)


def tune_markdown(r: TuneResult) -> str:
    lines = [f"# testbed tune: {r.policy}", "",
             f"{len(r.trials)} trials at load {r.load:g}, D {r.dilation:g}, SLO TTFT {r.slo_ttft_s:g} s and TPOT "
             f"{r.slo_tpot_s:g} s; wall time {r.wall_s / 60:.1f} min. Goodput: requests meeting both objectives "
             "per emulated second; price: the deployment per hour with its egress (1 without prices).", "",
             "## Pareto front (goodput per price up, P99 TTFT down)", "",
             *table_head(["trial", "knobs", "goodput/s", "goodput per price", "P99 TTFT s", "SLO met", "failed"])]
    for p in sorted((t for t in r.trials if t.number in r.front), key=lambda t: -(t.goodput_per_price or 0)):
        mark = " (defaults)" if p.number == 0 else (" (best)" if p.number == r.best else "")
        lines.append(f"| {p.number}{mark} | `{p.spec}` | {p.goodput_rps or 0:.3f} | {p.goodput_per_price or 0:.4g} | "
                     f"{p.ttft_p99_s if p.ttft_p99_s is not None else float('nan'):.2f} | "
                     f"{100 * (p.slo_attainment or 0):.0f} % | {p.failed} |")
    lines += ["", f"## The defaults and the best trial over {len(r.repeated.get('best', []))} draws "
              "(mean ± 95 % interval)", "",
              *table_head(["point", "knobs", "goodput/s", "goodput per price", "P99 TTFT s", "SLO met"])]
    for name, points in r.repeated.items():
        lines.append(f"| {name} | `{points[0].spec}` | {_ci(points, 'goodput_rps', '{:.3f}')} | "
                     f"{_ci(points, 'goodput_per_price', '{:.4g}')} | {_ci(points, 'ttft_p99_s', '{:.2f}')} | "
                     f"{_ci(points, 'slo_attainment', '{:.0f}', 100)} % |")
    return "\n".join(lines) + "\n"


def save_tune(r: TuneResult, out: Path) -> None:
    write_atomic(out / "tune.json", r.model_dump_json(indent=2))
    write_atomic(out / "tune.md", tune_markdown(r))
    front = [t for t in r.trials if t.number in r.front]
    marks = {0: "defaults", r.best: "best"}
    plot_tune([(t.ttft_p99_s, t.goodput_per_price, t.number) for t in r.trials],
              [(t.ttft_p99_s, t.goodput_per_price) for t in front], marks, f"testbed tune: {r.policy}",
              out / "tune.png")
