"""Experiment orchestration: a network session, one policy on a fresh network, a whole run.

``network_session`` builds a run's network and always tears it down (error, Ctrl-C,
SIGTERM). ``run_policy`` starts broker, workers and router for one ``PolicySpec`` on a
fresh network built from the emulation's wire scenario, replays the requests with
progress on stderr, and returns everything that came back (``PolicyRun``), including the
fidelity verdict. ``run_trace`` is ``testbed run``: the emulation plan (and ``auto``
dilation), every policy in turn, then the tables, the verdicts and the saved results.
The CLI only parses arguments and calls these.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from protocol.router_config import PolicyReport, RequestRecord
from protocol.worker_config import WorkerFaults, WorkerStats
from testbed.analysis.metrics import Slo
from testbed.analysis.results import PolicySummary, RunSummary, TraceInfo
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fidelity import Verdict, cpu_seconds, format_verdict, judge
from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault, Fault
from testbed.load.replay_client import ClientRecord
from testbed.net import runstate
from testbed.net.build import Impairment, Network
from testbed.policies.spec import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import RequestSpec, Workload


@contextlib.contextmanager
def network_session(scenario: Scenario, impairment: str) -> Iterator[Network]:
    """Build a network for this process's run, always tear it down (error, Ctrl-C, SIGTERM)."""
    runstate.clean_stale()  # the next start removes what a killed run left behind
    run = runstate.Run.new()
    net = None
    try:
        net = Network.up(scenario, run, impairment)  # type: ignore[arg-type]
        yield net
    finally:
        if net is not None:
            net.down()
        else:
            runstate.destroy(run.run_id, run.namespaces, run.processes)


class Progress:
    """Progress of one replay on stderr: a live line on a terminal, a line every 15 s otherwise."""

    def __init__(self, label: str) -> None:
        self.label, self.tty, self.last = label, sys.stderr.isatty(), 0.0

    def __call__(self, n: int, total: int, failed: int) -> None:
        msg = f"  {self.label}: {n}/{total} requests finished ({failed} failed)"
        if self.tty:
            print("\r" + msg, end="", file=sys.stderr, flush=True)
        elif time.monotonic() - self.last >= 15 or n == total:
            self.last = time.monotonic()
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


@dataclass
class PolicyRun:
    recs: dict[str, ClientRecord]
    router: dict[str, RequestRecord]
    workers: dict[str, WorkerStats]
    policy: PolicyReport
    verdict: Verdict
    impairment: str  # the WAN impairment backend that ran, and why
    faults: list[AppliedFault] = field(default_factory=list)


def run_policy(sc: Scenario, impairment: Impairment | str, policy: PolicySpec, specs: list[RequestSpec],
               dtype: str | None = None, faults: dict[str, WorkerFaults] | None = None,
               timeout_s: float = 1800.0, emulation: EmulationPlan | None = None,
               timeline: list[Fault] | None = None) -> PolicyRun:
    """Build network + cluster for one policy, replay ``specs`` (times already in real
    seconds) with the fault ``timeline`` applied, tear down. Returns records, statistics,
    the faults as applied and the fidelity verdict."""
    from testbed.deploy.cluster import Cluster
    from testbed.faults.inject import FaultInjector, annotate_failures

    wire = emulation.wire_scenario(sc) if emulation else sc
    d = emulation.dilation if emulation else 1.0
    with network_session(wire, impairment) as net:
        cl = Cluster.start(net, policy, faults=faults, dtype=dtype, emulation=emulation)
        injector = FaultInjector(net, timeline or [], d, emulation.wire_rate_bps if emulation else None,
                                 cl.restart_broker, cl.restart_worker)
        progress = Progress(policy.label)
        t0 = time.monotonic()
        try:
            recs = cl.replay(specs, timeout_s=timeout_s, progress=progress, on_start=injector.start)
        except Exception:
            for name in ["router", *cl.workers]:
                tail = cl.log_tail(name if name == "router" else f"worker-{name}", 1500)
                if tail:
                    print(f"--- {name} log ---\n{tail}", file=sys.stderr)
            raise
        finally:
            progress.close()
            applied = injector.stop()
        if applied:
            failed = {r.rid: ((r.sent - injector.t0_wall) / d, ((r.ended or r.sent) - injector.t0_wall) / d, r.error)
                      for r in recs.values() if r.error is not None and r.sent}  # sent: it lived
            for rid, why in annotate_failures(failed, applied).items():
                recs[rid].error = why
        wall = time.monotonic() - t0
        cpu: dict[str, float] = {}  # by name: a restarted worker's processes (and Mininet's node shells) add up
        for p in net.run.processes:
            if (s := cpu_seconds(p.pid)) is not None:
                cpu[p.name] = cpu.get(p.name, 0.0) + s
        router = cl.router_records()
        workers = cl.worker_stats()
        policy_report = cl.policy_stats()  # read before the run directory goes with the network
    verdict = judge(workers, net.delayline_stats_final, cpu, wall)
    return PolicyRun(recs, router, workers, policy_report, verdict, f"{net.impairment} ({net.impairment_reason})",
                     applied)


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


def emulation_plan(sc: Scenario, wl: Workload, specs: list[RequestSpec], dilation: float | str | None,
                   dtype: str | None = None) -> EmulationPlan:
    """The run's emulation: the scenario's model card at the trace's token scale, and the
    dilation given, the scenario's, or (``auto``) calibrated on this host."""
    from testbed.deploy.dilation import calibrate_dilation
    from testbed.traces.stats import hit_rates
    from workers.model import kv_bytes_per_token

    model = sc.model_dir()
    dtype = dtype or sc.workers.dtype
    b_r = kv_bytes_per_token(model, dtype)
    wanted = dilation if dilation is not None else (sc.emulation.time_dilation if sc.emulation else 1.0)
    if wanted != "auto":
        try:
            d = float(wanted)
        except ValueError as e:
            raise InputError(f"--dilation: expected a number or auto, got {wanted!r}") from e
        if not 0.1 <= d <= 1000:
            raise InputError(f"--dilation: must be between 0.1 and 1000, got {d:g}")
        return EmulationPlan.make(sc, wl.token_scale, d, b_r)
    plan = EmulationPlan.make(sc, wl.token_scale, 1.0, b_r)
    if not plan.emulating:
        return plan
    print("dilation auto: calibrating this host on trace-shaped work...", flush=True)
    rates = hit_rates(wl)
    new = [max(1, round(r.input_len * (1 - rates.get(r.rid, 0.0)))) for r in wl.requests]
    d, why = calibrate_dilation(sc, plan, specs, new, model, dtype)
    return EmulationPlan.make(sc, wl.token_scale, d, b_r, why)


def measure(sc: Scenario, spec: PolicySpec, plan: EmulationPlan, specs: list[RequestSpec], run: PolicyRun,
            slo: Slo) -> tuple[pd.DataFrame, PolicySummary]:
    """One policy's request rows and summary (latencies, cost, policy counters, verdict)."""
    from testbed.analysis.cost import cost_per_million_tokens, hardware_cost
    from testbed.analysis.metrics import itls, request_rows, summarize
    from testbed.policies import make_policy

    df = request_rows(run.recs, run.router, specs, plan.scales)
    measured = summarize(df, itls(run.recs, plan.scales), slo, run.recs, plan.scales)
    cost = hardware_cost(sc, make_policy(spec))
    per_mtok = cost_per_million_tokens(cost, measured.duration_s, measured.output_tokens_emulated) if cost else None
    return df, PolicySummary(**dict(measured), policy_stats=run.policy, fidelity=run.verdict, cost=cost,
                             cost_per_mtok=per_mtok, impairment=run.impairment, faults=run.faults)


def run_trace(sc: Scenario, wl: Workload, policies: list[PolicySpec], opts: RunOptions) -> int:
    """Replay ``wl`` under each policy on a fresh network; print, save and plot. Exit code:
    0 when every request of every policy completed with a passing fidelity verdict; 3 when
    a verdict failed (unless ``allow_infidelity``); 1 when requests failed."""
    from testbed.analysis import report
    from testbed.analysis.metrics import format_summary

    plan = emulation_plan(sc, wl, wl.specs(opts.speed), opts.dilation)
    d = plan.dilation
    specs = wl.specs(opts.speed / d)  # arrivals and think times stretched by the dilation
    out = opts.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    print(f"trace {wl.source}: {len(specs)} requests ({wl.format}, token scale {wl.token_scale}, "
          f"speed {opts.speed:g}); scenario {sc.name}; policies {', '.join(p.label for p in policies)}", flush=True)
    print(plan.describe(sc), flush=True)
    frames: dict[str, pd.DataFrame] = {}
    summaries: dict[str, PolicySummary] = {}
    workers: dict[str, dict[str, WorkerStats]] = {}
    for spec in policies:
        t0 = time.monotonic()
        run = run_policy(sc, opts.impairment, spec, specs, timeout_s=opts.timeout_s * d, emulation=plan,
                         timeline=[*sc.faults, *opts.faults])
        name = spec.label
        frames[name], s = measure(sc, spec, plan, specs, run, opts.slo)
        summaries[name] = s
        workers[name] = run.workers
        if len(summaries) == 1:
            print(f"WAN impairment: {run.impairment}", flush=True)
        print(format_summary(name, s) + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
        if max(Counter(w.role for w in run.workers.values()).values(), default=0) > 1:
            print("    requests by instance: " + ", ".join(f"{w} {n}" for w, n in s.requests_by_worker.items()),
                  flush=True)
        for rid, why in list(s.failures.items())[:5]:
            print(f"    failed {rid}: {why}")
    summary = RunSummary(
        trace=TraceInfo(trace=str(wl.source), format=wl.format, requests=len(wl.requests),
                        token_scale=wl.token_scale, block_size=wl.block_size, meta=wl.meta),
        speed=opts.speed, limit=opts.limit, window=opts.window, emulation=plan.summary(sc), scenario=sc,
        policies=summaries, workers=workers,
    )  # fmt: skip
    paths = report.save(out, frames, summary)
    print(f"\ntimes in {summary.units}")
    print(report.comparison_table(dict(summaries)))
    print()
    print(report.comparison_table(dict(summaries), report.PDD_COLUMNS))
    print()
    for name, s in summaries.items():
        print(format_verdict(name, s.fidelity))
    print(f"\nsaved: {', '.join(str(p) for p in paths)}")
    if not all(s.fidelity.passed for s in summaries.values()) and not opts.allow_infidelity:
        print("fidelity FAILED: these latencies measure this host, not the emulated system "
              "(raise --dilation, or pass --allow-infidelity to exit 0 anyway)", file=sys.stderr)
        return 3
    return 0 if all(s.failed == 0 for s in summaries.values()) else 1
