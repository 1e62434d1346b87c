"""Experiment orchestration: a network session, one policy on a fresh network, a whole run.

``network_session`` builds a run's network and always tears it down (error, Ctrl-C,
SIGTERM). ``run_policy`` starts broker, workers and router for one ``PolicySpec`` on a
fresh network, replays the requests with progress on stderr, and returns everything that
came back (``PolicyRun``). ``run_trace`` is ``testbed run``: every policy in turn, then
the tables and the saved results. The CLI only parses arguments and calls these.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed import runstate
from testbed.client import ClientRecord
from testbed.contracts import PolicyReport, RequestRecord
from testbed.metrics import Slo
from testbed.net.build import Impairment, Network
from testbed.policies.spec import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import RequestSpec, Workload
from workers.contracts import WorkerFaults, WorkerStats


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


def run_policy(sc: Scenario, impairment: Impairment | str, policy: PolicySpec, specs: list[RequestSpec],
               dtype: str | None = None, faults: dict[str, WorkerFaults] | None = None,
               timeout_s: float = 1800.0) -> PolicyRun:
    """Build network + cluster for one policy, replay ``specs``, tear down. Returns records."""
    from testbed.cluster import Cluster

    with network_session(sc, impairment) as net:
        cl = Cluster.start(net, policy, faults=faults, dtype=dtype)
        progress = Progress(policy.label)
        try:
            recs = cl.replay(specs, timeout_s=timeout_s, progress=progress)
        except Exception:
            for name in ["router", *cl.workers]:
                tail = cl.log_tail(name if name == "router" else f"worker-{name}", 1500)
                if tail:
                    print(f"--- {name} log ---\n{tail}", file=sys.stderr)
            raise
        finally:
            progress.close()
        router = cl.router_records()
        return PolicyRun(recs, router, cl.worker_stats(), cl.policy_stats())


@dataclass(frozen=True)
class RunOptions:
    """What ``testbed run`` was asked, beyond scenario, workload and policies."""

    impairment: str = "auto"
    speed: float = 1.0
    limit: int | None = None
    window: str | None = None
    slo: Slo = Slo()
    timeout_s: float = 1800.0
    out: Path | None = None


def run_trace(sc: Scenario, wl: Workload, policies: list[PolicySpec], opts: RunOptions) -> int:
    """Replay ``wl`` under each policy on a fresh network; print, save and plot. Exit code:
    0 when every request of every policy completed, 1 otherwise."""
    from testbed import report
    from testbed.metrics import format_summary, itls, request_rows, summarize

    specs = wl.specs(opts.speed)
    out = opts.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    info = wl.describe()
    print(f"trace {info['trace']}: {len(specs)} requests ({info['format']}, token scale {wl.token_scale}, "
          f"speed {opts.speed:g}); scenario {sc.name}; policies {', '.join(p.label for p in policies)}", flush=True)
    frames, summaries, workers = {}, {}, {}
    for spec in policies:
        t0 = time.monotonic()
        run = run_policy(sc, opts.impairment, spec, specs, timeout_s=opts.timeout_s)
        df = request_rows(run.recs, run.router, specs)
        name = spec.label
        frames[name] = df
        summaries[name] = {**summarize(df, itls(run.recs), opts.slo, run.recs),
                           "policy_stats": run.policy.model_dump(mode="json")}
        workers[name] = run.workers
        print(format_summary(name, summaries[name]) + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
        for rid, why in list(summaries[name]["failures"].items())[:5]:
            print(f"    failed {rid}: {why}")
    summary: dict[str, Any] = {
        "trace": info, "speed": opts.speed, "limit": opts.limit, "window": opts.window,
        "scenario": sc.model_dump(mode="json"), "policies": summaries,
        "workers": {p: {w: s.model_dump(mode="json") for w, s in ws.items()} for p, ws in workers.items()},
    }  # fmt: skip
    paths = report.save(out, frames, summary, workers)
    print()
    print(report.comparison_table(summaries))
    print()
    print(report.comparison_table(summaries, report.PDD_COLUMNS))
    print(f"\nsaved: {', '.join(str(p) for p in paths)}")
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1
