"""One emulated deployment of one policy, from network build to teardown.

``Deployment`` owns everything a run of one policy needs: the network (either backend,
built from the emulation's wire scenario), the broker, the workers and the router
(``Cluster``), the fault injector, CPU and memory sampling, the fidelity verdict, and the
teardown (on success, error, Ctrl-C or SIGTERM). What drives requests into it is a
``LoadDriver`` handed to ``run``: a trace replay, a soak loop, the HTTP front door of
``serve``. Every caller, ``testbed run``, ``soak``, ``serve``, ``verify``, the sweeps, the
benchmarks and the tests, gets the same typed ``PolicyRun`` back::

    with Deployment(scenario, policy, emulation=plan) as dep:
        run = dep.run(TraceReplay(specs, timeout_s))

``network_session`` is the network part alone, for commands that start no workers
(``net up``, ``net check``, the network benchmarks).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from protocol.topics import Topics
from protocol.worker_config import BrokerInfo, WorkerFaults
from testbed.deploy import forkserver
from testbed.deploy.cluster import Cluster
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fault_injection import FaultInjector, annotate_failures
from testbed.deploy.fidelity import host_steal_s, judge
from testbed.deploy.process_sampling import RssSampler, cpu_by_name
from testbed.deploy.run_record import ClientRecord, LineBins, PolicyRun
from testbed.errors import InputError
from testbed.faults.timeline import Fault
from testbed.net import runstate
from testbed.net.build import Network
from testbed.net.delayline_contract import DelayLineReport
from testbed.policies import PolicySpec
from testbed.scenario import Role, Scenario
from testbed.traces.workload import RequestSpec
from workers.transport import Transport

T = TypeVar("T")


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
            run.destroy()


class LoadTarget(Protocol):
    """What a load driver drives in this process: a simulated deployment
    (``testbed.sim.engine.SimDeployment``), whose client is a coroutine of its virtual-time
    loop. An emulated ``Deployment`` has the same properties; its client is a process of
    its own (``testbed.load.client_process``), started by the driver."""

    @property
    def dilation(self) -> float: ...

    @property
    def topics(self) -> Topics: ...

    @property
    def client_broker(self) -> BrokerInfo: ...

    def run_client(self, client: Callable[[Transport], Coroutine[Any, Any, T]]) -> T:
        """Run ``client(transport)`` from the client host and wait for it: the driver's
        requests and measurements, with the transport that reaches this deployment."""
        ...


class LoadDriver(Protocol):
    """What sends requests into a deployment and records what came back."""

    label: str
    samples_memory: bool  # sample every process's resident memory while it runs

    def drive(self, dep: Any, begin: Callable[[float], None]) -> tuple[list[RequestSpec],
                                                                     dict[str, ClientRecord]]:
        """Send the load; call ``begin(t0)`` (time.monotonic) when the first request is due,
        which starts the fault timeline and the sampling. Returns what was sent and the
        client's record of each request."""
        ...


# A load driver for a probe's requests: (specs, timeout s, label) -> the driver.
Replayer = Callable[[list[RequestSpec], float, str], LoadDriver]


class Deployment:
    """A context manager: ``__enter__`` builds and starts everything, ``run`` drives one load
    and returns the ``PolicyRun`` (tearing down as it reads the last statistics),
    ``__exit__`` tears down whatever is still up."""

    def __init__(self, scenario: Scenario, policy: PolicySpec, *, emulation: EmulationPlan | None = None,
                 impairment: str = "auto", dtype: str | None = None,
                 worker_faults: dict[str, WorkerFaults] | None = None, timeline: Sequence[Fault] = (),
                 logs_to: Path | None = None, trace_decisions: bool = False) -> None:
        self.scenario, self.policy, self.emulation = scenario, policy, emulation
        self.trace_decisions = trace_decisions
        self.impairment, self.dtype, self.worker_faults = impairment, dtype, worker_faults
        self.timeline = list(timeline)
        self.logs_to = logs_to  # the processes' logs are copied here at teardown
        self._stack = contextlib.ExitStack()
        self._net: Network | None = None
        self._cluster: Cluster | None = None
        self._injector: FaultInjector | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Deployment:
        forkserver.prestart()  # its imports overlap the network build
        try:
            wire = self.emulation.wire_scenario(self.scenario) if self.emulation else self.scenario
            self._net = self._stack.enter_context(network_session(wire, self.impairment))
            self._net.logs_to = self.logs_to
            # A worker a fault kills, or whose clock it steps, is a process of its own.
            killed = frozenset(f.host for f in self.timeline if f.kind in ("kill", "clock-step") and f.host is not None)
            self._cluster = Cluster.start(self._net, self.policy, faults=self.worker_faults, dtype=self.dtype,
                                          emulation=self.emulation, alone=killed,
                                          trace_decisions=self.trace_decisions)
            self._injector = FaultInjector(self._net, self.timeline, self.dilation,
                                           self.emulation.wire_rate_bps if self.emulation else None,
                                           self._cluster.restart_broker, self._cluster.restart_worker,
                                           stop_broker=self._cluster.stop_broker,
                                           kill_router=self._cluster.kill_router,
                                           step_clock=self._cluster.step_clock)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Tear everything down (idempotent): workers, router and broker end with the network."""
        self._stack.close()

    # ------------------------------------------------------------------ what drivers and tests use
    @property
    def net(self) -> Network:
        return _started(self._net)

    @property
    def cluster(self) -> Cluster:
        return _started(self._cluster)

    @property
    def injector(self) -> FaultInjector:
        return _started(self._injector)

    @property
    def dilation(self) -> float:
        return self.emulation.dilation if self.emulation else 1.0

    @property
    def topics(self) -> Topics:
        return self.cluster.topics

    @property
    def client_broker(self) -> BrokerInfo:
        return self.cluster.access.client

    @property
    def client_host(self) -> str:
        clients = self.scenario.hosts_with_role(Role.CLIENT)
        if not clients:
            raise InputError(f"{self.scenario.source}: scenario has no host with role client")
        return clients[0]

    @property
    def client_ns(self) -> str:
        return self.net.ns_of(self.client_host)

    def processes(self) -> list[tuple[str, int]]:
        return [(p.name, p.pid) for p in self.net.run.processes]

    # ------------------------------------------------------------------ one load, start to end
    def run(self, load: LoadDriver) -> PolicyRun:
        """Drive ``load``, apply the fault timeline, sample, collect every record and
        statistic, tear down, judge fidelity. One run per deployment."""
        net, cl, injector = self.net, self.cluster, self.injector
        sampler = RssSampler(self.processes, floors=cl.memory_floors) if load.samples_memory else None

        before_load: list[DelayLineReport | None] = [None]
        steal0 = host_steal_s()

        def begin(t0: float) -> None:
            # The verdict judges the delay line from here: frames late while workers start up
            # (8 of them forked at once on 2 cores) carry no measured request.
            before_load[0] = net.delayline_stats()
            injector.start(t0)
            if sampler is not None:
                sampler.start()

        t0 = time.monotonic()
        try:
            specs, recs = load.drive(self, begin)
        except Exception:
            self._print_log_tails()
            raise
        finally:
            applied = injector.stop()
            memory = sampler.stop() if sampler is not None else []
        wall = time.monotonic() - t0
        if applied:
            d = self.dilation
            failed = {r.rid: ((r.sent - injector.t0_stamp) / d, ((r.ended or r.sent) - injector.t0_stamp) / d, r.error)
                      for r in recs.values() if r.error is not None and r.sent}  # sent: it lived
            for rid, why in annotate_failures(failed, applied).items():
                recs[rid].error = why
        cpu = cpu_by_name(self.processes())
        steal = host_steal_s() - steal0
        router, workers, policy_report = cl.router_records(), cl.worker_stats(), cl.policy_stats()
        deaths = cl.worker_deaths()
        self.close()  # the delay line's final statistics come with the network's teardown
        final = net.delayline_stats_final
        delays = {name: d.delay_ms for name, d in net.scenario.wan_directions().items()}  # the wire's
        verdict = judge(workers, final.since(before_load[0]) if final else None, cpu, wall, steal, delays)
        return PolicyRun(specs=specs, recs=recs, router=router, workers=workers, policy=policy_report,
                         verdict=verdict, impairment=f"{net.impairment} ({net.impairment_reason})",
                         faults=applied, wall_s=wall, memory=memory, rss=sampler.series if sampler else [],
                         fault_t0=injector.t0_stamp, deaths=deaths, wan_line=_line_bins(final),
                        decisions=cl.decisions())

    def _print_log_tails(self) -> None:
        for name in ["router", *self.cluster.groups]:
            tail = self.cluster.log_tail(name, 1500)
            if tail:
                print(f"--- {name} log ---\n{tail}", file=sys.stderr)


def _line_bins(final: DelayLineReport | None) -> dict[str, LineBins]:
    """The delay line's KV counters per direction (none from netem, or a line that died)."""
    if final is None or not final.bin_s:
        return {}
    return {name: LineBins(final.bins_t0, final.bin_s, d.kv_bins) for name, d in final.directions.items()}


def _started(part: T | None) -> T:
    if part is None:
        raise RuntimeError("the deployment is not started (use it as a context manager)")
    return part
