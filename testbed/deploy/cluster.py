"""Start the inference side on a built network: broker, workers, router.

``Cluster`` turns the scenario's hosts into processes: mosquitto and the router on the
``router`` host, a prefill worker on each ``prefill`` host, a decode worker on each
``decode`` and each ``relay-decode`` host (the same worker; a relay's part in PDD is set
per request by the router). Workers are forked from the fork server (``forkserver.py``), which
has imported torch once for all of them. Every process is started inside its namespace and
recorded in the run, so teardown (and ``testbed clean`` after a crash) ends them by PID.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from control.ended import SETTLE_S
from protocol import clock
from protocol.messages import MAX_PROMPT_TOKENS
from protocol.router_config import (
    Decision,
    PolicyContext,
    PolicyReport,
    RequestRecord,
    RouterConfig,
    WorkerDeath,
    WorkerEndpoint,
)
from protocol.topics import Topics
from protocol.worker_config import (
    KV_PORT,
    PREFILL_ROLES,
    BrokerInfo,
    DeviceSpec,
    MemoryReport,
    RunAs,
    Scales,
    WorkerConfig,
    WorkerFaults,
    WorkerRole,
    WorkerStats,
)
from testbed.deploy.accounts import Accounts, accounts_for, component_env
from testbed.deploy.broker import BrokerAccess, BrokerFiles, launch_broker, start_broker
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.forkserver import launch_worker
from testbed.deploy.model_files import ensure_model
from testbed.errors import InputError
from testbed.net import netns, runstate
from testbed.net.build import Network
from testbed.policies import PolicySpec
from testbed.scenario import Role, Scenario
from workers.model_dir import kv_bytes_per_token, read_config

# The router on the C library's allocator instead of Python's small-object arenas: a burst of
# requests in flight (the backlog after a WAN outage: thousands of prompt tokens, each an int
# object) fills arenas that long-lived objects (index entries) then pin, so its RSS stayed at
# the burst's high-water mark (+29 MB after 150 requests at once, measured); glibc's heap
# gives those pages back when the router trims (+2 MB), for ~20 % more of the router's CPU.
ROUTER_ENV = {"PYTHONMALLOC": "malloc"}
T = TypeVar("T")
WORKER_ROLES: dict[Role, WorkerRole] = {Role.PREFILL: "prefill", Role.DECODE: "decode",
                                        Role.RELAY_DECODE: "relay-decode", Role.COLOCATED: "colocated"}


def _parsed_lines(text: str, parse: Callable[[str], T], what: str) -> list[T]:
    """Every line of a file a component wrote that parses; the others are reported (how
    many, and the first's reason) and skipped: a component's bad line costs only itself."""
    out: list[T] = []
    bad: list[str] = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            out.append(parse(line))
        except ValueError as e:  # pydantic's ValidationError is one
            bad.append(f"line {i}: {str(e).splitlines()[0][:200]}")
    if bad:
        print(f"{what}: skipped {len(bad)} malformed line(s) ({bad[0]})", file=sys.stderr, flush=True)
    return out


def _written(path: Path) -> str:
    """A file an unprivileged process wrote ("" if it wrote none): never through a link it
    may have put there."""
    try:
        return runstate.read_nofollow(path)
    except FileNotFoundError:
        return ""


def worker_roles(sc: Scenario) -> dict[str, str]:
    """Host name -> worker role of every host that runs a worker."""
    return {host: WORKER_ROLES[spec.role] for dc in sc.datacenters.values() for host, spec in dc.hosts.items()
            if spec.role in WORKER_ROLES}


def worker_configs(sc: Scenario, run_id: str, ip_of: Callable[[str], str], broker: BrokerInfo | dict[str, BrokerInfo],
                   model: str, dtype: str | None = None, faults: dict[str, WorkerFaults] | None = None,
                   emulation: EmulationPlan | None = None, kv_token: str = "",
                   accounts: Accounts | None = None) -> dict[str, WorkerConfig]:
    """Every worker's configuration, from the scenario: the one place a WorkerConfig is built
    (the emulation's and the simulator's). ``ip_of``: a host's address on the emulated
    network; ``broker``: each worker's own credential (by name), or one for all; ``accounts``:
    the account each role becomes and the folder it writes its statistics in (None: no
    statistics, no drop)."""
    ws = sc.workers
    d = emulation.dilation if emulation else 1.0
    s_in = emulation.scales.s_in if emulation else 1  # emulated tokens per replayed one
    out = {}
    for dc in sc.datacenters.values():
        for host, spec in dc.hosts.items():
            role = WORKER_ROLES.get(spec.role)
            if role is None:
                continue
            device = sc.device_spec(host)
            out[host] = WorkerConfig(
                name=host, role=role, run_id=run_id, host_ip=ip_of(host), kv_port=KV_PORT,
                broker=broker if isinstance(broker, BrokerInfo) else broker[host], kv_token=kv_token,
                model_path=model, compute=spec.compute, dtype=dtype or ws.dtype, threads=ws.threads,
                block_size=ws.block_size, prefill_chunk=ws.prefill_chunk,
                cache_tokens=-(-(ws.prefill_cache_tokens if role in PREFILL_ROLES else ws.decode_cache_tokens)
                               // s_in),
                max_batch=ws.max_batch, kv_timeout_s=ws.kv_timeout_s * d, kv_streams_per_peer=ws.kv_streams_per_peer,
                kv_transfer=ws.kv_transfer, prefill_token_budget=ws.prefill_token_budget,
                kv_connections=ws.kv_connections, kv_layer_groups=ws.kv_layer_groups,
                kv_read_timeout_s=ws.kv_read_timeout_s * d, kv_hello_wait_s=ws.kv_hello_wait_s * d,
                kv_capacity_tokens=(None if role == "prefill" or ws.decode_kv_tokens is None
                                    else -(-ws.decode_kv_tokens // s_in)),
                device=device,
                cost=emulation.cost() if emulation else None,
                kv_state_bytes=emulation.state_wire_bytes if emulation else 0,
                scales=emulation.scales if emulation else Scales(),
                stats_path=str(accounts.folder(role) / f"worker-{host}.json") if accounts else "",
                run_as=accounts.of(role) if accounts else None,
                faults=(faults or {}).get(host, WorkerFaults()),
            )  # fmt: skip
    return out


def _prefill_tflops(d: DeviceSpec) -> float | None:
    """What a policy weighs instances of unlike devices by: the compute a prefill gets."""
    return d.peak_tflops * d.compute_efficiency if d.peak_tflops else None


def router_config(sc: Scenario, run_id: str, policy: PolicySpec, workers: dict[str, WorkerConfig],
                  broker: BrokerInfo, records_path: Path, model: str, dtype: str | None = None,
                  emulation: EmulationPlan | None = None, run_as: RunAs | None = None) -> RouterConfig:
    """The router's configuration, from the (wire) scenario and the workers': the one place a
    RouterConfig is built (the emulation's and the simulator's)."""
    ws = sc.workers
    d = emulation.dilation if emulation else 1.0
    router = sc.hosts_with_role(Role.ROUTER)[0]
    fwd = sc.wan.forward
    cost = emulation.cost() if emulation else None
    context = PolicyContext(
        wan_rate_bps=fwd.rate_mbit * 1e6 if fwd.rate_mbit else None, wan_rtt_s=2 * fwd.delay_ms / 1000, dilation=d,
        wan_back_rate_bps=sc.wan.reverse.rate_mbit * 1e6 if sc.wan.reverse.rate_mbit else None,
        kv_bytes_per_token=kv_bytes_per_token(model, dtype or ws.dtype), block_size=ws.block_size,
        kv_state_bytes=emulation.state_wire_bytes if emulation else 0,
        decode_cache_tokens=-(-ws.decode_cache_tokens // (emulation.scales.s_in if emulation else 1)),
        home_dc=sc.datacenter_of(router),
        token_scale=emulation.scales.s_in if emulation else 1,
        prefill_exact_states=cost is not None and cost.linear_layers > 0, kv_transfer=ws.kv_transfer,
    )  # fmt: skip
    endpoints = {h: WorkerEndpoint(role=c.role, dc=sc.datacenter_of(h), host=c.host_ip, kv_port=c.kv_port,
                                   prefill_tflops=_prefill_tflops(sc.device_spec(h)))
                 for h, c in workers.items()}
    card = read_config(model)
    # A real model holds prompt and answer within its positions; a modeled worker only within
    # what a KV transfer's HELLO may name.
    positions = getattr(card, "max_position_embeddings", None)
    real = any(c.compute != "modeled" for c in workers.values())
    max_context = min(MAX_PROMPT_TOKENS, positions) if real and isinstance(positions, int) and positions > 1 \
        else MAX_PROMPT_TOKENS
    return RouterConfig(run_id=run_id, broker=broker, policy=policy, workers=endpoints,
                        request_timeout_s=ws.request_timeout_s * d, records_path=str(records_path),
                        dilation=d, unreachable_grace_s=ws.unreachable_grace_s * d,
                        context=context, cache_outputs=ws.cache_outputs,
                        failure_detection=ws.failure_detection, run_as=run_as, vocab_size=card.vocab_size,
                        max_context=max_context)


def process_groups(sc: Scenario, cfgs: dict[str, WorkerConfig], alone: set[str]) -> dict[str, list[str]]:
    """Process name -> the hosts whose workers it runs. Modeled instances of one datacenter
    and role share a process, up to ``workers.modeled_per_process`` each; a real worker, and
    one a fault will kill or that carries a test fault, runs alone as ``worker-<host>``."""
    per = sc.workers.modeled_per_process
    shared: dict[tuple[str, str], list[str]] = {}
    out: dict[str, list[str]] = {}
    for host, cfg in cfgs.items():
        if cfg.compute == "modeled" and per > 1 and host not in alone and cfg.faults == WorkerFaults():
            shared.setdefault((sc.datacenter_of(host), cfg.role), []).append(host)
        else:
            out[f"worker-{host}"] = [host]
    for (dc, role), hosts in shared.items():
        parts = [hosts[i : i + per] for i in range(0, len(hosts), per)]
        for i, part in enumerate(parts):
            name = f"worker-{part[0]}" if len(part) == 1 else (
                f"workers-{dc}-{role}" + (f"-{i + 1}" if len(parts) > 1 else ""))
            out[name] = part
    return out


@dataclass
class Cluster:
    net: Network
    policy: PolicySpec
    access: BrokerAccess  # every component's broker credential; ``admin`` for the orchestrator
    broker: subprocess.Popen[bytes]
    broker_host: str
    broker_files: BrokerFiles
    workers: dict[str, WorkerConfig] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)  # process name -> hosts it runs
    router: subprocess.Popen[bytes] = field(init=False)
    router_grace_s: float = 10.0  # how long the router may take to stop
    accounts: Accounts = field(init=False)  # each component's identity and folder
    skews: dict[str, float] = field(default_factory=dict)  # process -> its wall clock's steps so far (clock-step)

    @property
    def topics(self) -> Topics:
        return Topics(self.net.run.run_id)

    @property
    def records_path(self) -> Path:
        """The router's records, in the folder its account owns (with its other files beside)."""
        return self.accounts.folder("router") / "router-records.jsonl"

    @classmethod
    def start(cls, net: Network, policy: PolicySpec, faults: dict[str, WorkerFaults] | None = None,
              dtype: str | None = None, emulation: EmulationPlan | None = None,
              alone: frozenset[str] = frozenset(), trace_decisions: bool = False) -> Cluster:
        """Broker, workers and router on ``net`` (built from the wire scenario). ``emulation``
        gives the workers their pacing and stretches every timeout by its dilation; ``alone``:
        hosts whose worker must have a process of its own (a fault will kill it)."""
        sc = net.scenario
        routers = sc.hosts_with_role(Role.ROUTER)
        if not routers:
            raise InputError(f"{sc.source}: scenario has no host with role router")
        broker, access, files = start_broker(net, routers[0], worker_roles(sc))
        cl = cls(net, policy, access, broker, routers[0], files)
        ws = sc.workers
        model = ensure_model(sc.model_dir())
        # Only the run's workers may hand a KV receiver a transfer: a per-run token in HELLO.
        cl.accounts = accounts_for(net.run, ws.run_as)
        cl.workers = worker_configs(sc, net.run.run_id, net.ip_of, access.workers, model, dtype, faults, emulation,
                                    kv_token=secrets.token_urlsafe(16), accounts=cl.accounts)
        cl.groups = process_groups(sc, cl.workers, set(alone))
        for name, hosts in cl.groups.items():
            if len(hosts) > 1:  # each instance opens its sockets in its own host's namespace
                for h in hosts:
                    cl.workers[h] = cl.workers[h].model_copy(update={"netns": net.plan.hosts[h].ns})
                text = "[" + ",".join(cl.workers[h].model_dump_json() for h in hosts) + "]"
            else:
                text = cl.workers[hosts[0]].model_dump_json()
            runstate.write_private(net.run.dir / f"{name}.cfg.json", text)  # holds broker credentials
            cl._start_process(name)
        rcfg = router_config(sc, net.run.run_id, policy, cl.workers, access.router, cl.records_path, model, dtype,
                             emulation, cl.accounts.of("router"))
        rcfg = rcfg.model_copy(update={"trace_decisions": trace_decisions})
        rpath = net.run.dir / "router.cfg.json"
        runstate.write_private(rpath, rcfg.model_dump_json())
        cl.router_grace_s = 10 + SETTLE_S * rcfg.dilation  # it may wait for KV on its way (SETTLE_S)
        cl.router = net.spawn(routers[0], [sys.executable, "-m", "control", str(rpath)], name="router",
                              log=net.run.dir / "router.log",
                              env=component_env(ROUTER_ENV))
        return cl

    def restart_worker(self, host: str) -> str:
        """Start a killed worker again from its configuration (empty caches); it announces
        itself "up" and the router routes to it again."""
        if host not in self.workers:
            raise LookupError(f"no worker on {host}")
        name = self.process_of(host)
        if self.groups[name] != [host]:
            raise LookupError(f"worker {host} shares process {name}: only a worker alone is restarted")
        return f"{name} started again (pid {self._start_process(name)})"

    def process_of(self, host: str) -> str:
        return next(name for name, hosts in self.groups.items() if host in hosts)

    def _start_process(self, name: str) -> int:
        """Fork process ``name`` (in its first host's namespace) from its saved configuration
        and record it in the run."""
        ns, d = self.net.plan.hosts[self.groups[name][0]].ns, self.net.run.dir
        pid = launch_worker(ns, d / f"{name}.cfg.json", d / f"{name}.log", name)
        self.net.run.add_process(pid, name, ns)
        return pid

    def restart_broker(self, downtime_s: float) -> str:
        """Stop mosquitto (it saves its sessions), wait ``downtime_s``, start it again; every
        component reconnects on its own (``protocol.mqtt_session``)."""
        old = self.broker
        netns.stop_child(old, 10)
        time.sleep(downtime_s)
        t0 = time.monotonic()
        self.broker = launch_broker(self.net, self.broker_host, self.broker_files)
        took = time.monotonic() - t0
        return f"mosquitto pid {old.pid} stopped; pid {self.broker.pid} listening {took:.2f} s after its start"

    def stop_broker(self) -> str:
        """The broker stopped for good (``broker-stop``): every component is left without it."""
        netns.stop_child(self.broker, 10)
        return f"mosquitto pid {self.broker.pid} stopped for good"

    def kill_router(self) -> str:
        """SIGKILL of the router (``router-kill``): its records of ended requests are on disk
        already; its last will tells the clients."""
        if self.router.poll() is not None:
            return f"the router (pid {self.router.pid}) had already ended: nothing killed"
        self.router.kill()
        self.router.wait()
        return f"the router (pid {self.router.pid}) ended at once (SIGKILL)"

    def step_clock(self, host: str | None, s: float) -> str:
        """Step the wall clock of the component on ``host`` (None: every component) by ``s``
        seconds (``clock-step``): root writes the process's skew beside its configuration
        (``protocol.clock.steps_file``, readable, in root's folder) and sends it SIGUSR2; the
        host's clock is not touched."""
        sc = self.net.scenario
        names = {h: self.process_of(h) for h in self.workers}
        names[self.broker_host] = "router"
        names.update({h: "client" for h in sc.hosts_with_role(Role.CLIENT)})
        targets = sorted(set(names.values())) if host is None else [names[host]]
        done = []
        for name in targets:
            proc = next((p for p in reversed(self.net.run.processes) if p.name == name), None)
            if proc is None or proc.starttime is None:
                done.append(f"{name}: not running")
                continue
            self.skews[name] = self.skews.get(name, 0.0) + s
            path = clock.steps_file(self.net.run.dir / f"{name}.cfg.json")
            runstate.write_readable(path, json.dumps({"skew_s": self.skews[name]}))
            sent = netns.signal_exact(proc.pid, proc.starttime, signal.SIGUSR2)
            done.append(f"{name} {self.skews[name]:+g} s" if sent else f"{name}: had ended")
        return "wall clock stepped: " + ", ".join(done)

    def router_records(self) -> dict[str, RequestRecord]:
        """Stop the router (it writes its records on exit) and read them."""
        if self.router.poll() is None:
            time.sleep(0.3)  # let the last events (e.g. kv_sent after done) reach it
            netns.stop_child(self.router, self.router_grace_s)
        recs = _parsed_lines(_written(self.records_path), RequestRecord.model_validate_json, "the router's records")
        return {rec.rid: rec for rec in recs}

    def policy_stats(self) -> PolicyReport:
        """The policy's own counters (written by the router on exit)."""
        text = _written(Path(str(self.records_path) + ".policy.json"))
        return PolicyReport.model_validate_json(text) if text else PolicyReport()

    def decisions(self) -> list[Decision]:
        """The router's traced decisions (``--trace-decisions``; none otherwise)."""
        text = _written(Path(str(self.records_path) + ".decisions.jsonl"))
        return _parsed_lines(text, Decision.model_validate_json, "the router's decisions")

    def worker_deaths(self) -> list[WorkerDeath]:
        """The workers the router declared dead, in order (appended by the router as it happened)."""
        text = _written(Path(str(self.records_path) + ".deaths.jsonl"))
        return _parsed_lines(text, WorkerDeath.model_validate_json, "the router's deaths")

    def memory_floors(self) -> dict[int, list[tuple[float, int]]]:
        """Every worker process's and the router's memory floor so far, by pid
        (``workers.allocator``): read while a soak runs, so a process killed later keeps its."""
        reports = [w.memory for w in self.worker_stats().values() if w.memory is not None]
        with contextlib.suppress(ValueError):
            if text := _written(Path(str(self.records_path) + ".memory.json")):
                reports.append(MemoryReport.model_validate_json(text))
        return {m.pid: m.floor for m in reports}

    def worker_stats(self) -> dict[str, WorkerStats]:
        out = {}
        for host, cfg in self.workers.items():
            if not (text := _written(Path(cfg.stats_path))):
                continue
            try:  # from its own file, under its own name: a worker speaks for no other
                stats = WorkerStats.model_validate_json(text)
            except ValueError as e:
                print(f"{host}: statistics refused: {str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
                continue
            if stats.worker != cfg.name:
                print(f"{host}: statistics refused: its file names worker {stats.worker!r}", file=sys.stderr,
                      flush=True)
                continue
            out[host] = stats
        return out

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.net.run.dir / f"{name}.log"
        return p.read_text()[-n:] if p.exists() else ""
