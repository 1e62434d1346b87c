"""Instantiate a scenario's network: namespaces, veth links, bridges, routes, WAN shaping.

``Network`` is the running counterpart of a ``NetworkPlan``. ``Network.up`` builds
everything or nothing: any failure undoes what was built and raises ``BuildError`` naming
the step that failed. The WAN's delay, jitter and loss come from a ``WanImpairment``
(``testbed.net.impairment``: netem or the delay line). ``Network.down`` closes it and
deletes every namespace of
the run (deleting a namespace deletes its links and qdiscs). The run registry
(``testbed.net.runstate``) records each object before it is created, so ``testbed clean``
can finish the job after a crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import BuildError, CapabilityError, InputError
from testbed.net import netns, runstate, shaping
from testbed.net.delayline_contract import DelayLineReport, DirectionOverride
from testbed.net.impairment import ImpairmentChoice, WanImpairment, choose
from testbed.net.mininet_nodes import MininetNodes
from testbed.net.nodes import NodeBackend, NodeKind, Pyroute2Nodes
from testbed.net.plan import TCP_MEM, NetworkPlan, make_plan, size_lan
from testbed.outputs import open_folder
from testbed.scenario import Scenario
from workers.privilege import open_regular


@dataclass
class Network:
    scenario: Scenario
    run: runstate.Run
    plan: NetworkPlan
    nodes: NodeBackend  # who creates namespaces, links and bridges (testbed/net/nodes.py)
    wan: WanImpairment | None = None  # the WAN's delay, jitter and loss (testbed/net/impairment.py)
    timings: dict[str, float] = field(default_factory=dict)
    delayline_stats_final: DelayLineReport | None = None  # last statistics, read at teardown
    logs_to: Path | None = None  # where the processes' logs are copied at teardown (the run folder)

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def up(cls, scenario: Scenario, run: runstate.Run, impairment: ImpairmentChoice = "auto") -> Network:
        t0 = time.monotonic()
        plan = make_plan(scenario, run.prefix)
        net = cls(scenario, run, plan, make_backend(plan.backend, run))
        try:
            net._build(impairment)
        except BaseException as e:
            net.down()
            if isinstance(e, (CapabilityError, KeyboardInterrupt)):
                raise
            raise BuildError(
                f"network build failed at step '{net._step}': {e}; everything built was removed"
            ) from e
        net.timings["up_s"] = time.monotonic() - t0
        run.info["impairment"] = {"backend": net.impairment, "reason": net.impairment_reason}
        run.info["network_backend"] = net.nodes.name
        run.save()
        return net

    def down(self) -> None:
        t0 = time.monotonic()
        self.run.stop_applications()
        if self.wan is not None:
            self.delayline_stats_final = self.wan.close()
        if self.logs_to is not None:
            self.run.stop_strays()  # nothing of the run's applications runs while root reads their folder
            self._keep_logs(self.logs_to)
        self.nodes.close()
        self.run.destroy()
        self.timings["down_s"] = time.monotonic() - t0

    def _keep_logs(self, dest: Path) -> None:
        """Every process's log, whole, before the run's state folder goes (a log that cannot
        be copied is reported; teardown goes on). Only logs root opened itself: the regular
        files named ``*.log`` in the run's folder and in its subfolders that root owns and no
        one else can write (the broker's); a component's own folder is never walked."""
        try:
            folder = open_folder(dest)
        except (OSError, InputError) as e:
            print(f"logs not kept in {dest}: {e}", flush=True)
            return
        try:
            for log in root_logs(self.run.dir):
                name = "-".join(log.relative_to(self.run.dir).parts)
                try:  # copied from the descriptor that was checked: no link, no FIFO, a regular file
                    src = os.fdopen(open_regular(log), "rb")
                except OSError as e:
                    print(f"log {log} not kept: {e}", flush=True)
                    continue
                try:
                    out = os.fdopen(open_regular(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=folder), "wb")
                except OSError as e:
                    src.close()
                    print(f"log {log} not kept in {dest}: {e}", flush=True)
                    continue
                with src, out:
                    shutil.copyfileobj(src, out)
        finally:
            os.close(folder)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---------------------------------------------------------------- helpers for users
    def ns_of(self, host: str) -> str:
        return self.plan.hosts[host].ns

    def ip_of(self, host: str) -> str:
        return self.plan.hosts[host].ip

    @property
    def impairment(self) -> str:
        return self.wan.name if self.wan else "none"

    @property
    def impairment_reason(self) -> str:
        return self.wan.reason if self.wan else ""

    def delayline_stats(self) -> DelayLineReport | None:
        return self.wan.stats() if self.wan else None

    def describe(self) -> str:
        """The built network as a person reads it: datacenters, hosts, WAN shaping."""
        p = self.plan
        lines = [f"scenario {self.scenario.name}: network backend {p.backend}, "
                 f"impairment backend {self.impairment} ({self.impairment_reason})"]
        for dc in p.dcs.values():
            lines.append(f"  datacenter {dc.name}: {dc.subnet} gateway ns {dc.gw_ns}")
            for h in p.hosts.values():
                if h.dc == dc.name:
                    role = self.scenario.datacenters[dc.name].hosts[h.name].role
                    lines.append(f"    {h.name:14} {h.ip:15} ns {h.ns:24} {role}")
        for (src, dst), s in p.wan_shaping.items():
            rate = f"{s.rate_bps / 1e6:.1f} Mbit/s" if s.rate_bps else "unshaped"
            bdp = p.bdp_frames(src, dst)
            frames = f", {bdp:.0f} frames in flight per RTT" if bdp is not None else ""
            lines.append(
                f"  wan {src}->{dst}: {rate}, delay {s.delay_ms:g} ms, jitter {s.jitter_ms:g} ms, "
                f"loss {s.loss_pct}%, buffer {s.queue_bytes} B, burst {s.burst_bytes} B, MTU {p.wan_frame_mtu}{frames}"
            )
        lines.append(f"  up in {self.timings.get('up_s', 0):.3f} s")
        return "\n".join(lines)

    def spawn(self, host_or_ns: str, argv: list[str], name: str, log: Path | None = None,
              **kw: Any) -> subprocess.Popen[bytes]:
        """Start a process inside a host's namespace and record it in the run."""
        ns = self.plan.hosts[host_or_ns].ns if host_or_ns in self.plan.hosts else host_or_ns
        proc = netns.spawn(ns, argv, log_path=log, **kw)
        self.run.add_process(proc.pid, name, ns)
        return proc

    # ---------------------------------------------------------------- faults
    def impair_wan(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        """Set every WAN direction's fault state at once, in wire units (a direction not in
        ``overrides`` goes back to its configuration)."""
        if self.wan is None:
            raise BuildError("the WAN is not built")
        self.wan.impair(overrides)

    def set_wan_rate(self, src: str, dst: str, rate_bps: int | None) -> None:
        """The line's rate of one direction (wire bits/s); None: back to its configuration."""
        s = self.plan.wan_shaping[(src, dst)]
        if s.rate_bps is None:
            raise BuildError(f"WAN {src}->{dst} has no rate to change (unshaped)")
        with netns.iproute(self.plan.wan_ns) as ipr:
            shaping.change_rate(ipr, self.plan.dcs[dst].wan_port, rate_bps or s.rate_bps, s.burst_bytes)

    # ---------------------------------------------------------------- build steps
    _step = "start"

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        self._step = name
        yield

    def _build(self, impairment: ImpairmentChoice) -> None:
        p = self.plan
        nodes: list[tuple[str, str, NodeKind]] = [(h.ns, h.name, "host") for h in p.hosts.values()]
        nodes += [(dc.gw_ns, f"gw-{dc.name}", "gateway") for dc in p.dcs.values()] + [(p.wan_ns, "wan", "wan")]
        with self._stage(f"create namespaces ({self.nodes.name})"):
            for ns, label, kind in nodes:
                self.run.add_namespace(ns)  # recorded before it exists
                self.nodes.add_node(ns, label, kind)
                self.run.hold(ns)
                self._init_namespace(ns)
        with self._stage("choose impairment backend"):
            self.wan = choose(impairment, p, self.run.dir, int(self.run.run_id, 16), self.spawn)
        for h in p.hosts.values():
            with self._stage(f"host {h.name} link"):
                self.nodes.add_link(h.ns, "eth0", p.dcs[h.dc].gw_ns, h.gw_port, p.mtu)
        for dc in p.dcs.values():
            with self._stage(f"gateway {dc.gw_ns}"):
                ports = [h.gw_port for h in p.hosts.values() if h.dc == dc.name]
                self.nodes.add_bridge(dc.gw_ns, dc.bridge, ports, p.mtu)
                with netns.iproute(dc.gw_ns) as ipr:
                    br = ipr.link_lookup(ifname=dc.bridge)[0]
                    ipr.addr("add", index=br, address=dc.gw_lan_ip, prefixlen=24)
                    for idx in [br] + [ipr.link_lookup(ifname=port)[0] for port in ports]:
                        ipr.link("set", index=idx, state="up")
                self.nodes.note_address(dc.gw_ns, dc.bridge, dc.gw_lan_ip, 24)
                netns.write_sysctl(dc.gw_ns, "net.ipv4.ip_forward", 1)
        for h in p.hosts.values():
            dc = p.dcs[h.dc]
            with self._stage(f"host {h.name} address"):
                with netns.iproute(h.ns) as ipr:
                    idx = ipr.link_lookup(ifname="eth0")[0]
                    ipr.addr("add", index=idx, address=h.ip, prefixlen=24)
                    ipr.link("set", index=idx, state="up")
                    ipr.route("add", dst="0.0.0.0/0", gateway=dc.gw_lan_ip)
                self.nodes.note_address(h.ns, "eth0", h.ip, 24)
            if dc.lan_rate_mbit:
                with self._stage(f"host {h.name} lan shaping"):
                    self._shape_lan(h.ns, "eth0", dc.lan_rate_mbit)
                    self._shape_lan(dc.gw_ns, h.gw_port, dc.lan_rate_mbit)
        self._build_wan()

    def _init_namespace(self, ns: str) -> None:
        with netns.iproute(ns) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        # IPv4 only: no router solicitations or DAD chatter on the emulated links.
        netns.write_sysctl(ns, "net.ipv6.conf.all.disable_ipv6", 1)
        netns.write_sysctl(ns, "net.ipv6.conf.default.disable_ipv6", 1)
        netns.write_sysctl(ns, "net.ipv4.tcp_rmem", TCP_MEM)
        netns.write_sysctl(ns, "net.ipv4.tcp_wmem", TCP_MEM)
        # A KV connection kept open between transfers (workers/kv_wire.py) keeps its window,
        # as a transfer engine's would; the default would restart slow start after each idle.
        netns.write_sysctl(ns, "net.ipv4.tcp_slow_start_after_idle", 0)

    def _shape_lan(self, ns: str, ifname: str, rate_mbit: float) -> None:
        rate = int(rate_mbit * 1e6)
        s = size_lan(rate, self.plan.mtu)
        with netns.iproute(ns) as ipr:
            shaping.add_rate_limit(ipr, ifname, rate, s.burst_bytes, s.queue_bytes)

    def _build_wan(self) -> None:
        p = self.plan
        a, b = p.wan_between
        with self._stage("WAN links"):
            for dc in (p.dcs[a], p.dcs[b]):
                self.nodes.add_link(dc.gw_ns, "wan0", p.wan_ns, dc.wan_port, p.wan_frame_mtu)
                other = p.dcs[b if dc.name == a else a]
                with netns.iproute(dc.gw_ns) as ipr:
                    idx = ipr.link_lookup(ifname="wan0")[0]
                    ipr.addr("add", index=idx, address=dc.gw_wan_ip, prefixlen=30)
                    ipr.link("set", index=idx, state="up")
                    ipr.route("add", dst=str(other.subnet), gateway=other.gw_wan_ip)
                self.nodes.note_address(dc.gw_ns, "wan0", dc.gw_wan_ip, 30)
                with netns.iproute(p.wan_ns) as ipr:
                    ipr.link("set", index=ipr.link_lookup(ifname=dc.wan_port)[0], state="up")
        with self._stage("WAN offloads off"):
            for dc in (p.dcs[a], p.dcs[b]):
                shaping.disable_offloads(dc.gw_ns, "wan0")
                shaping.disable_offloads(p.wan_ns, dc.wan_port)
        assert self.wan is not None
        with self._stage(f"WAN shaping and impairment ({self.wan.name})"):
            self.wan.build()


def make_backend(name: str, run: runstate.Run) -> NodeBackend:
    if name == "mininet":
        return MininetNodes(run)
    return Pyroute2Nodes(run)


def root_logs(run_dir: Path) -> list[Path]:
    """The logs root opened itself for a run's processes: regular files named ``*.log`` in
    ``run_dir`` and in those of its subfolders that root owns and no other account can
    write; nothing deeper, and no folder a component owns (it could nest or link anything)."""
    logs: list[Path] = []
    folders = [run_dir]
    with os.scandir(run_dir) as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
                    folders.append(Path(e.path))
    for d in folders:
        with os.scandir(d) as entries:
            logs += [Path(e.path) for e in entries if e.name.endswith(".log") and e.is_file(follow_symlinks=False)]
    return sorted(logs)
