"""``testbed run``: one trace replayed under each policy, each on a deployment of its own.

The emulation plan (and ``auto`` dilation) is made once; then every policy in turn gets a
fresh ``Deployment`` driven by a ``TraceReplay``, its rows and summary saved as it ends and
its processes' logs kept under ``logs/<policy>/``; then the side-by-side tables, the
fidelity verdicts, the report and plots (``testbed report`` rebuilds them).
"""

from __future__ import annotations

import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd

from protocol.worker_config import WorkerStats
from testbed.analysis import report
from testbed.analysis.metrics import Slo, format_summary
from testbed.analysis.policy_summary import measure
from testbed.analysis.results import SUMMARY_FILE, PolicySummary, RunSummary, TraceInfo, load_run
from testbed.deploy import dilation_cache
from testbed.deploy.fidelity import format_verdict
from testbed.engines import kind
from testbed.errors import EXIT_INFIDELITY, InputError
from testbed.experiments.engine_runs import RUNS
from testbed.faults.timeline import Fault
from testbed.faults.wan_trace import faults_of
from testbed.load.retry import RetryPolicy
from testbed.load.trace_replay import TraceReplay
from testbed.outputs import new_run_dir, write_atomic
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import Workload


@dataclass(frozen=True)
class RunOptions:
    """What ``testbed run`` was asked, beyond scenario, workload and policies."""

    impairment: str = "auto"
    dilation: float | str | None = None  # None: the scenario's (auto unless it says otherwise)
    allow_infidelity: bool = False
    speed: float = 1.0
    limit: int | None = None
    window: str | None = None
    slo: Slo = Slo()
    timeout_s: float = 1800.0
    out: Path | None = None
    faults: tuple[Fault, ...] = ()  # from the command line; the scenario's own come first
    retry: RetryPolicy = RetryPolicy()  # the client's, as an agent's SDK retries
    resume: bool = False  # keep the policies a matching run already saved in ``out``
    engine: Literal["emulation", "sim"] = "emulation"  # real processes and bytes, or the simulator
    jobs: int = 1  # an experiment's simulations at once (``experiments/parallel.py``)
    executor: Literal["local", "ray"] = "local"  # where an experiment's replays run (``ray_executor.py``)
    ray_address: str | None = None  # the cluster (None: RAY_ADDRESS)
    ray_retries: int = 2  # a replay whose worker or node died, sent again at most this often
    node: str = ""  # the host that ran the replay (a Ray task names its node; "": this host)
    trace_decisions: bool = False  # each policy's plans, with what they weighed: decisions-<policy>.jsonl


@dataclass(frozen=True)
class Replay:
    """One ``run_trace``'s inputs: what an experiment hands to an executor, here or on a cluster."""

    sc: Scenario
    wl: Workload
    policies: list[PolicySpec]
    opts: RunOptions


def run_trace(sc: Scenario, wl: Workload, policies: list[PolicySpec], opts: RunOptions) -> int:
    """Replay ``wl`` under each policy on a fresh network; print, save and plot. Exit code:
    0 when every request of every policy completed with a passing fidelity verdict; 3 when
    a verdict failed (unless ``allow_infidelity``); 1 when requests failed."""
    started = time.monotonic()
    engine = RUNS[kind(opts.engine)]
    plan = engine.plan(sc, wl, opts.speed, opts.dilation)
    d = plan.dilation
    specs = wl.specs(opts.speed / d)  # arrivals and think times stretched by the dilation
    out = opts.out or new_run_dir("")
    print(f"trace {wl.source}: {len(specs)} requests ({wl.format}, token scale {wl.token_scale}, "
          f"speed {opts.speed:g}); scenario {sc.name}; policies {', '.join(p.label for p in policies)}", flush=True)
    if isinstance(cap := wl.meta.get("max_context"), dict):
        print(f"max context {cap['tokens']} tokens: {cap['truncated']} of the trace's {cap['of']} prompts truncated "
              f"to their last ones ({cap['dropped_tokens']} tokens dropped)", flush=True)
    print(plan.describe(sc) + (f"\nengine: {engine.kind.about}" if engine.kind.virtual_time else ""), flush=True)
    frames: dict[str, pd.DataFrame] = {}
    summaries: dict[str, PolicySummary] = {}
    workers: dict[str, dict[str, WorkerStats]] = {}

    def summary_so_far() -> RunSummary:
        return RunSummary(
            trace=TraceInfo(trace=str(wl.source), format=wl.format, requests=len(wl.requests),
                            token_scale=wl.token_scale, block_size=wl.block_size, meta=wl.meta),
            speed=opts.speed, limit=opts.limit, window=opts.window, emulation=plan.summary(sc), scenario=sc,
            policies=summaries, workers=workers, engine=opts.engine,
            node=opts.node or socket.gethostname(), wall_s=round(time.monotonic() - started, 1),
        )  # fmt: skip

    if opts.resume:
        frames, summaries, workers = kept_policies(out, summary_so_far(), policies)
    timeline = [*sc.faults, *faults_of(sc.wan_directions()), *opts.faults]  # the line's trace as faults too
    for spec in policies:
        if spec.label in summaries:
            continue
        t0 = time.monotonic()
        load = TraceReplay(specs, opts.timeout_s * d, spec.label, retry=opts.retry)
        with engine.deployment(sc, spec, plan, timeline, opts.impairment, out / "logs" / spec.label,
                               opts.trace_decisions) as dep:
            run = dep.run(load)
        if opts.trace_decisions:
            lines = "".join(d.model_dump_json() + "\n" for d in run.decisions)
            write_atomic(out / f"decisions-{spec.name}.jsonl", lines)
        name = spec.label
        frames[name], s = measure(sc, spec, plan, run, opts.slo)
        summaries[name] = s
        workers[name] = run.workers
        # Saved as each policy ends: an interrupted run keeps the policies it finished.
        report.save_data(out, frames, summary_so_far())
        if len(summaries) == 1:
            print(f"WAN impairment: {run.impairment}", flush=True)
        print(format_summary(name, s) + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
        if max(Counter(w.role for w in run.workers.values()).values(), default=0) > 1:
            print("    requests by instance: " + ", ".join(f"{w} {n}" for w, n in s.requests_by_worker.items()),
                  flush=True)
        for rid, why in list(s.failures.items())[:5]:
            print(f"    failed {rid}: {why}")
    order = [p.label for p in policies]  # kept ones first came from the folder
    frames = {n: frames[n] for n in order}
    summaries = {n: summaries[n] for n in order}
    workers = {n: workers[n] for n in order}
    summary = summary_so_far()
    paths = report.save(out, frames, summary)
    print(f"\ntimes in {summary.units}")
    print(report.comparison_table(dict(summaries)))
    print()
    print(report.comparison_table(dict(summaries), report.PDD_COLUMNS))
    print()
    if len(summaries) > 1:
        print("the PDD report's figures beside this run's (its deployment and load at scale: make reproduce;\n"
              "docs/results.md says where and why they differ)")
        print(report.paper_comparison(summary, headline=True))
        print()
    for name, s in summaries.items():
        print(format_verdict(name, s.fidelity, opts.engine))
    print(f"\nsaved: {', '.join(str(p) for p in paths)}")
    broken = {n: s.component_errors for n, s in summaries.items() if s.component_errors}
    for name, errors in broken.items():
        print(f"{name}: {len(errors)} exception(s) no component caught (a bug; the requests they touched failed): "
              + "; ".join(errors[:3]), file=sys.stderr)
    if broken:
        return 1
    needs = [s.fidelity.need for s in summaries.values() if s.fidelity.need is not None]
    need = max(needs) if needs else None
    if all(s.fidelity.passed for s in summaries.values()) and plan.auto_key is not None:
        lower = dilation_cache.passed_at(plan.auto_key, d, need)  # the verdicts say how much margin was left
        if lower is not None:
            print(f"dilation auto: every step would have kept up at D {d * (need or 1):.2f}; the next auto run of "
                  f"this scenario and trace here runs at D {lower:g}", flush=True)
    if not all(s.fidelity.passed for s in summaries.values()):
        if plan.auto_key is not None:  # auto chose too low: the next run starts higher
            raised = dilation_cache.failed_at(plan.auto_key, d, need)
            print(f"dilation auto: D {d:g} did not keep up on this host; the next auto run of this scenario and "
                  f"trace here starts at D {raised:g}", file=sys.stderr)
        if not opts.allow_infidelity:
            print("fidelity FAILED: these latencies measure this host, not the emulated system "
                  "(raise --dilation, or pass --allow-infidelity to exit 0 anyway)", file=sys.stderr)
            return EXIT_INFIDELITY
    return 0 if all(s.failed == 0 for s in summaries.values()) else 1


def kept_policies(out: Path, now: RunSummary, policies: list[PolicySpec]) -> tuple[
        dict[str, pd.DataFrame], dict[str, PolicySummary], dict[str, dict[str, WorkerStats]]]:
    """``--resume``: the policies a run saved in ``out`` finished, when that run replayed what
    this one would (trace and its selection, load, scenario, emulation); nothing when ``out``
    holds no run yet. A folder holding a different run is an error naming what differs: its
    rows are never mixed with this run's."""
    if not (out / SUMMARY_FILE).exists():
        return {}, {}, {}
    saved, df = load_run(out)
    fields = ("trace", "speed", "limit", "window", "emulation", "scenario")
    for f in fields:
        a, b = getattr(saved, f), getattr(now, f)
        a, b = (x.model_dump(mode="json") if hasattr(x, "model_dump") else x for x in (a, b))
        if a != b:
            hint = " (pass the --dilation it ran at)" if f == "emulation" else ""
            raise InputError(f"{out}: --resume: this folder holds a different run ({f} differs{hint}); "
                             "choose another --out")
    wanted = {p.label for p in policies}
    kept = [name for name in saved.policies if name in wanted]
    if kept:
        print(f"--resume: kept from {out}: {', '.join(kept)}", flush=True)
    frames = {str(n): g.drop(columns="policy").reset_index(drop=True)
              for n, g in df.groupby("policy", sort=False) if n in kept}
    return frames, {n: saved.policies[n] for n in kept}, {n: saved.workers.get(n, {}) for n in kept}
