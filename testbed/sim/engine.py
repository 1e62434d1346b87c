"""``--engine sim``: one policy's deployment in virtual time, running the deployment's own code.

``SimDeployment`` is the simulator's ``Deployment``: the same scenario, emulation plan and
fault timeline in, the same ``PolicyRun`` out, driven by the same load drivers
(``LoadTarget``). What runs is the testbed's code, not a model of it: the router
(``control/router.py``) with its policy and failure detector, every worker
(``workers/``: admission, continuous batching, chunked-prefill pricing, radix caches and
DRC, the handoff modes, cut-offs) with its device model (``workers/device.py``), and the
replay client with its retries. They run as asyncio tasks of one process on a
``VirtualLoop``, reading its clock (``protocol.clock``), each with a transport
(``SimTransport``) whose broker (``bus.py``), KV connections (``kv.py``) and links
(``links.py``) are models. Every worker computes as a modeled instance (``workers/modeled.py``):
its steps cost the virtual time its device profile prices and no host time.

What the simulator refuses, by name (``check_simulable``): a worker on a device without a
roofline (the emulation prices such a worker by the host CPU that computes it), a scenario
without an emulated model, and the test-only worker faults. Determinism: one seed drives
the link model's jitter; nothing else draws a random number or reads a host clock, so the
same inputs give the same records.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiomqtt

from control.router import Router
from protocol import clock
from protocol.router_config import Decision, PolicyReport, RequestRecord, WorkerDeath
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo, WorkerConfig, WorkerFaults, WorkerStats
from testbed.deploy.cluster import router_config, worker_configs
from testbed.deploy.deployment import LoadDriver
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fault_injection import FaultInjector, annotate_failures
from testbed.deploy.fidelity import judge
from testbed.deploy.model_files import ensure_model
from testbed.deploy.run_record import LineBins, PolicyRun
from testbed.errors import InputError
from testbed.faults.timeline import Fault
from testbed.net.delayline_contract import DirectionOverride
from testbed.net.line_tap import KV_BIN_S
from testbed.net.plan import NetworkPlan, make_plan
from testbed.policies import PolicySpec
from testbed.scenario import Role, Scenario
from testbed.sim.bus import SimBroker
from testbed.sim.flows import host_congestion
from testbed.sim.kv import SimNet
from testbed.sim.network import LinkModel
from testbed.sim.scope import check_simulable
from testbed.sim.vloop import EPOCH, VirtualLoop
from workers.allocator import WATCH
from workers.kinds import make_worker
from workers.model_dir import kv_bytes_per_token
from workers.runtime import Worker
from workers.transport import Transport

T = TypeVar("T")
RUN_ID = "sim"
STOP_GRACE_S = 30.0  # virtual seconds the components get to stop (their last messages, statistics)
IMPAIRMENT = "link model (simulator; testbed/sim/network.py)"
SIM_REASON = "simulated: virtual time, no host to keep up with"


def sim_plan(sc: Scenario, token_scale: int, dtype: str | None = None) -> EmulationPlan:
    """The emulation plan the simulator runs on: the scenario's model card at the trace's
    token scale, dilation 1 (virtual time has no host to keep up with)."""
    check_simulable(sc)
    b_r = kv_bytes_per_token(ensure_model(sc.model_dir()), dtype or sc.workers.dtype)
    return EmulationPlan.make(sc, token_scale, 1.0, b_r, SIM_REASON)


class _Wan:
    """The links as the fault injector acts on them (``FaultInjector``'s ``WanControl``)."""

    def __init__(self, plan: NetworkPlan, links: LinkModel) -> None:
        self.plan, self.links = plan, links

    def impair_wan(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        for key in self.plan.wan_shaping:
            o = overrides.get(key, DirectionOverride())
            self.links.impair(key, o.down, o.loss_pct, o.extra_delay_ms)

    def set_wan_rate(self, src: str, dst: str, rate_bps: int | None) -> None:
        if self.plan.wan_shaping[(src, dst)].rate_bps is None:
            raise InputError(f"WAN {src}->{dst} has no rate to change (unshaped)")
        self.links.set_rate((src, dst), rate_bps)


class SimDeployment:
    """A context manager like ``Deployment``: ``__enter__`` builds the simulated deployment,
    ``run`` drives one load through it and returns the ``PolicyRun``."""

    engine = "sim"

    def __init__(self, scenario: Scenario, policy: PolicySpec, *, emulation: EmulationPlan,
                 timeline: Sequence[Fault] = (), seed: int = 0, dtype: str | None = None,
                 worker_faults: dict[str, WorkerFaults] | None = None, trace_decisions: bool = False) -> None:
        check_simulable(scenario, worker_faults)
        self.trace_decisions = trace_decisions
        if emulation.dilation != 1.0:
            raise ValueError("the simulator runs in emulated time: its plan's dilation is 1")
        self.scenario, self.policy, self.emulation = scenario, policy, emulation
        self.timeline, self.seed, self.dtype = list(timeline), seed, dtype
        self.wire = emulation.wire_scenario(scenario)
        self.plan = make_plan(self.wire, RUN_ID)
        self.router_host = self.wire.hosts_with_role(Role.ROUTER)[0]
        clients = self.wire.hosts_with_role(Role.CLIENT)
        if not clients:
            raise InputError(f"{scenario.source}: scenario has no host with role client")
        self.client_host = clients[0]
        self._broker_info = BrokerInfo(host=self.plan.hosts[self.router_host].ip, port=1883, username="sim",
                                       password="sim")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.loop: VirtualLoop | None = None
        self.workers: dict[str, Worker] = {}
        self.configs: dict[str, WorkerConfig] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.skews: dict[str, clock.Skew] = {}  # host -> its component's wall clock (clock-step)
        self.crashes: list[str] = []
        self.errors: list[str] = []  # exceptions no component caught (a bug: reported with the run)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SimDeployment:
        self._tmp = tempfile.TemporaryDirectory(prefix="pdd-sim-")
        self.loop = VirtualLoop()
        self.loop.set_exception_handler(self._uncaught)
        self.congestion = host_congestion()  # the emulation's TCP is this host's
        self.links = LinkModel(self.loop, self.wire, self.plan, self.seed, self.congestion)
        self.broker = SimBroker(self.links, self.router_host)
        self.net = SimNet(self.links, self.broker)
        model = ensure_model(self.scenario.model_dir())
        cfgs = worker_configs(self.wire, RUN_ID, lambda h: self.plan.hosts[h].ip, self._broker_info, model,
                              self.dtype, None, self.emulation)
        self.configs = {h: c.model_copy(update={"compute": "modeled"}) for h, c in cfgs.items()}
        self.records_path = Path(self._tmp.name) / "router-records.jsonl"
        self.router_cfg = router_config(self.wire, RUN_ID, self.policy, self.configs, self._broker_info,
                                        self.records_path, model, self.dtype, self.emulation).model_copy(
            update={"trace_decisions": self.trace_decisions})
        self.injector = FaultInjector(_Wan(self.plan, self.links), self.timeline, 1.0, self.emulation.wire_rate_bps,
                                      self._restart_broker, self._restart_worker, self._kill_worker,
                                      stop_broker=self._stop_broker, kill_router=self._kill_router,
                                      step_clock=self._step_clock)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------ what load drivers use
    @property
    def dilation(self) -> float:
        return 1.0

    @property
    def topics(self) -> Topics:
        return Topics(RUN_ID)

    @property
    def client_broker(self) -> BrokerInfo:
        return self._broker_info

    def run_client(self, client: Callable[[Transport], Coroutine[Any, Any, T]]) -> T:
        """Run the whole deployment and ``client`` (from the client host) in virtual time until
        the client returns; then stop every component as the emulation does."""
        assert self.loop is not None
        with _simulated(self.loop):
            return self.loop.run_until_complete(self._main(client))

    # ------------------------------------------------------------------ one load
    def run(self, load: LoadDriver) -> PolicyRun:
        wall0, cpu0 = time.monotonic(), _cpu_s()

        def begin(t0: float) -> None:
            self._faults = asyncio.ensure_future(self.injector.run_async(t0))

        specs, recs = load.drive(self, begin)
        applied = self.injector.stop()
        if applied:
            t0 = self.injector.t0_stamp
            failed = {r.rid: (r.sent - t0, (r.ended or r.sent) - t0, r.error)
                      for r in recs.values() if r.error is not None and r.sent}
            for rid, why in annotate_failures(failed, applied).items():
                recs[rid].error = why
        wall = time.monotonic() - wall0
        stats = {h: w.stats() for h, w in sorted(self.workers.items())}
        verdict = judge(stats, None, {"simulator": _cpu_s() - cpu0}, wall)
        errors = [*(f"a component failed: {c}" for c in self.crashes), *(f"uncaught: {e}" for e in self.errors)]
        if errors:  # no verdict of the run's fidelity stands on a bug (sweeps mark the point failed)
            verdict = verdict.model_copy(update={"passed": False, "reasons": [*verdict.reasons, *errors[:5]]})
        run = PolicyRun(specs=specs, recs=recs, router=self._records(), workers=stats, policy=self._policy_report,
                        verdict=verdict, impairment=f"{IMPAIRMENT}, TCP {self.congestion}", faults=applied,
                        wall_s=wall,
                        fault_t0=self.injector.t0_stamp, deaths=self._deaths(), engine="sim",
                        decisions=self._decisions(),
                        wan_line={f"{a}->{b}": LineBins(EPOCH, KV_BIN_S, [round(x) for x in lk.kv_bins or []])
                                  for (a, b), lk in self.links.wan.items()},
                        component_errors=errors)
        self.close()
        return run

    async def _main(self, client: Callable[[Transport], Coroutine[Any, Any, T]]) -> T:
        self._faults: asyncio.Future[None] | None = None
        self.router = Router(self.router_cfg, self.net.transport(self.router_host))
        self._stop_router = asyncio.Event()
        self.skews[self.client_host] = clock.own_wall_clock()  # this task is the client's
        self.tasks["router"] = self._component(self.router_host, self.router.main(self._stop_router))
        for host in self.configs:
            self._start_worker(host)
        try:
            return await client(self.net.transport(self.client_host))
        finally:
            await self._stop_all()

    def _start_worker(self, host: str) -> None:
        cfg = self.configs[host]
        transport = self.net.transport(host)
        w: Worker = make_worker(cfg, transport)
        self.workers[host] = w
        self.tasks[host] = self._component(host, self._serve(host, w))

    def _component(self, host: str, main: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """``main`` as the task of the component on ``host``, with a wall clock of its own
        (every task it starts shares it): what a process is in the emulation. One started
        again keeps its host's skew, as a process started again on a stepped machine."""
        ctx = contextvars.copy_context()
        skew = ctx.run(clock.own_wall_clock)
        skew.s = self.skews[host].s if host in self.skews else 0.0
        self.skews[host] = skew
        return asyncio.get_running_loop().create_task(main, context=ctx)

    async def _serve(self, host: str, w: Worker) -> None:
        try:
            await w.main(signals=False)
        except SystemExit as e:  # a task of the worker failed: it said why and ended
            self.crashes.append(f"{host}: {e.code}")
            self.net.kill_host(host)

    async def _stop_all(self) -> None:
        """The router first (it fails what is still in flight and writes its records), then
        every worker (their last statistics), as the emulation's teardown does."""
        if self._faults is not None:
            self._faults.cancel()
        self._stop_router.set()
        await _bounded(self.tasks["router"], STOP_GRACE_S)
        self._policy_report: PolicyReport = self.router.policy.stats()
        for w in self.workers.values():
            w.stopping.set()
        await _bounded(asyncio.gather(*(t for h, t in self.tasks.items() if h != "router")), STOP_GRACE_S)
        for w in self.workers.values():
            for t in list(w.tasks):
                t.cancel()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in pending:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pending, return_exceptions=True)

    # ------------------------------------------------------------------ faults
    def _kill_worker(self, host: str) -> str:
        task, w = self.tasks.get(host), self.workers.get(host)
        if task is None or w is None or task.done():
            return f"the worker on {host} had already ended: nothing killed"
        for t in list(w.tasks):
            t.cancel()
        task.cancel()
        self.net.kill_host(host)
        return f"the worker on {host} ended at once (as by SIGKILL)"

    def _restart_worker(self, host: str) -> str:
        if host not in self.configs:
            raise LookupError(f"no worker on {host}")
        self._start_worker(host)
        return f"the worker on {host} started again (empty caches)"

    def _stop_broker(self) -> str:
        self.broker.stop()
        return "the broker stopped for good"

    def _kill_router(self) -> str:
        task = self.tasks.get("router")
        if task is None or task.done():
            return "the router had already ended: nothing killed"
        task.cancel()
        self.net.kill_host(self.router_host)  # its connections end without a goodbye: its will goes out
        return "the router ended at once (as by SIGKILL)"

    def _step_clock(self, host: str | None, s: float) -> str:
        done = []
        for h in sorted(self.skews) if host is None else [host]:
            self.skews[h].s += s
            done.append(f"{h} {self.skews[h].s:+g} s")
        return "wall clock stepped: " + ", ".join(done)

    def _restart_broker(self, downtime_s: float) -> str:
        self.broker.stop()
        assert self.loop is not None
        self.loop.call_later(downtime_s, self.broker.start)
        return f"the broker stopped; it listens again {downtime_s:g} s later"

    # ------------------------------------------------------------------ what the run left
    def _records(self) -> dict[str, RequestRecord]:
        out: dict[str, RequestRecord] = {}
        if self.records_path.exists():
            for line in self.records_path.read_text().splitlines():
                rec = RequestRecord.model_validate_json(line)
                out[rec.rid] = rec
        return out

    def _decisions(self) -> list[Decision]:
        path = Path(str(self.records_path) + ".decisions.jsonl")
        return [Decision.model_validate_json(x) for x in path.read_text().splitlines()] if path.exists() else []

    def _deaths(self) -> list[WorkerDeath]:
        path = Path(str(self.records_path) + ".deaths.jsonl")
        return [WorkerDeath.model_validate_json(x) for x in path.read_text().splitlines()] if path.exists() else []

    def worker_stats(self) -> dict[str, WorkerStats]:
        return {h: w.stats() for h, w in sorted(self.workers.items())}

    def _uncaught(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, aiomqtt.MqttError | asyncio.CancelledError):
            return  # a connection of a component that was stopped or killed
        self.errors.append(f"{context.get('message')}: {exc!r}")
        print(f"simulator: uncaught in a component: {context.get('message')}: {exc!r}", file=sys.stderr, flush=True)


async def _bounded(aw: Any, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(aw) if isinstance(aw, asyncio.Future) else aw, timeout_s)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _simulated(loop: VirtualLoop) -> Iterator[None]:
    """The components' clocks read the loop's virtual time; the memory watch (a thread, and
    the host's memory) is off."""
    watching = WATCH.enabled
    WATCH.enabled = False
    try:
        with clock.installed(loop.wall, loop.time):
            yield
    finally:
        WATCH.enabled = watching
