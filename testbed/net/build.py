"""Instantiate a scenario's network: namespaces, veth links, bridges, routes, WAN shaping.

``Network`` is the running counterpart of a ``NetworkPlan``. ``Network.up`` builds
everything or nothing: any failure undoes what was built and raises ``BuildError`` naming
the step that failed. ``Network.down`` stops the delay line and deletes every namespace of
the run (deleting a namespace deletes its links and qdiscs). The run registry
(``testbed.net.runstate``) records each object before it is created, so ``testbed clean``
can finish the job after a crash.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from testbed.errors import BuildError, CapabilityError
from testbed.net import netns, runstate, shaping
from testbed.net.delayline_contract import (
    DelayLineConfig,
    DelayLineControl,
    DelayLineReport,
    DirectionConfig,
    DirectionOverride,
)
from testbed.net.mininet_nodes import MininetNodes
from testbed.net.nodes import NodeBackend, NodeKind, Pyroute2Nodes
from testbed.net.plan import NetworkPlan, Shaping, make_plan, size_lan
from testbed.scenario import Scenario

Impairment = Literal["auto", "netem", "delayline"]

# Large TCP windows: a WAN of 1 Gbit/s x 40 ms needs 5 MB in flight, a 10G LAN more.
TCP_MEM = "4096 33554432 134217728"


@dataclass
class Network:
    scenario: Scenario
    run: runstate.Run
    plan: NetworkPlan
    nodes: NodeBackend  # who creates namespaces, links and bridges (testbed/net/nodes.py)
    impairment: str = "none"
    impairment_reason: str = ""
    delayline: subprocess.Popen[bytes] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    delayline_stats_final: DelayLineReport | None = None  # last statistics, read at teardown

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def up(cls, scenario: Scenario, run: runstate.Run, impairment: Impairment = "auto") -> Network:
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
        if self.delayline and self.delayline.poll() is None:
            self.delayline.send_signal(signal.SIGTERM)
            try:
                self.delayline.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.delayline.kill()
                self.delayline.wait()
        self.delayline_stats_final = self.delayline_stats()
        self.nodes.close()
        runstate.destroy(self.run.run_id, self.run.namespaces, self.run.processes)
        self.run.namespaces.clear()
        self.run.processes.clear()
        self.timings["down_s"] = time.monotonic() - t0

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
    def stats_path(self) -> Path:
        return self.run.dir / "delayline-stats.json"

    def delayline_stats(self) -> DelayLineReport | None:
        try:
            return DelayLineReport.model_validate_json(self.stats_path.read_text())
        except (OSError, ValueError):
            return None

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
    @property
    def control_path(self) -> Path:
        return self.run.dir / "delayline-control.json"

    def impair_wan(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        """Set every WAN direction's fault state at once, in wire units (a direction not in
        ``overrides`` goes back to its configuration). Delay line: a control file and SIGUSR1;
        netem: its qdisc changed in place (down = 100 % loss)."""
        if self.impairment == "netem":
            with netns.iproute(self.plan.wan_ns) as ipr:
                for (src, dst), s in self.plan.wan_shaping.items():
                    o = overrides.get((src, dst), DirectionOverride())
                    shaping.change_netem(ipr, self.plan.dcs[dst].wan_port, s, self.plan.wan_frame_mtu,
                                         loss_pct=100.0 if o.down else o.loss_pct, extra_delay_ms=o.extra_delay_ms)
            return
        if self.delayline is None or self.delayline.poll() is not None:
            raise BuildError("the delay line is not running")
        control = DelayLineControl(directions={f"{src}->{dst}": o for (src, dst), o in overrides.items()})
        tmp = self.control_path.with_suffix(".tmp")
        tmp.write_text(control.model_dump_json())
        tmp.replace(self.control_path)
        self.delayline.send_signal(signal.SIGUSR1)

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

    def _build(self, impairment: Impairment) -> None:
        p = self.plan
        nodes: list[tuple[str, str, NodeKind]] = [(h.ns, h.name, "host") for h in p.hosts.values()]
        nodes += [(dc.gw_ns, f"gw-{dc.name}", "gateway") for dc in p.dcs.values()] + [(p.wan_ns, "wan", "wan")]
        with self._stage(f"create namespaces ({self.nodes.name})"):
            for ns, label, kind in nodes:
                self.run.add_namespace(ns)  # recorded before it exists
                self.nodes.add_node(ns, label, kind)
                self._init_namespace(ns)
        with self._stage("choose impairment backend"):
            self._choose_impairment(impairment)
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

    def _choose_impairment(self, requested: Impairment) -> None:
        needs = any(s.delay_ms or s.jitter_ms or s.loss_pct for s in self.plan.wan_shaping.values())
        if requested == "delayline":
            self.impairment, self.impairment_reason = "delayline", "requested"
            return
        ok, why = shaping.netem_available(self.plan.wan_ns)
        if requested == "netem":
            if not ok:
                raise CapabilityError(f"--impairment netem: {why}. Use --impairment delayline (or auto).")
            self.impairment, self.impairment_reason = "netem", "requested"
        elif ok:
            self.impairment, self.impairment_reason = "netem", why
        else:
            self.impairment, self.impairment_reason = "delayline", why
        if not needs and self.impairment == "delayline":
            self.impairment_reason += "; no delay/jitter/loss configured, delay line forwards only"

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
        netem = self.impairment == "netem"
        with self._stage("WAN shaping"), netns.iproute(p.wan_ns) as ipr:
            for (_src, dst), s in p.wan_shaping.items():
                # Frames of src->dst leave the WAN namespace through the port facing dst.
                shaping.add_wan_qdiscs(ipr, p.dcs[dst].wan_port, s, p.wan_frame_mtu, netem)
            if netem:
                ipr.link("add", ifname="br0", kind="bridge", mtu=p.wan_frame_mtu)
                br = ipr.link_lookup(ifname="br0")[0]
                for dc in (p.dcs[a], p.dcs[b]):
                    ipr.link("set", index=ipr.link_lookup(ifname=dc.wan_port)[0], master=br)
                ipr.link("set", index=br, state="up")
        if not netem:
            with self._stage("start delay line"):
                self._start_delayline()

    def _start_delayline(self) -> None:
        p = self.plan
        ready = self.run.dir / "delayline.ready"
        cfg = DelayLineConfig(
            ports={dc: p.dcs[dc].wan_port for dc in p.wan_between},
            directions=[
                DirectionConfig(src=src, dst=dst, delay_ms=s.delay_ms, jitter_ms=s.jitter_ms, loss_pct=s.loss_pct,
                                max_backlog_bytes=_backlog_cap(s))
                for (src, dst), s in p.wan_shaping.items()
            ],
            stats_path=str(self.stats_path), ready_path=str(ready), seed=int(self.run.run_id, 16),
            control_path=str(self.control_path),
        )  # fmt: skip
        self.delayline = self.spawn(
            p.wan_ns, [sys.executable, "-m", "testbed.net.delayline", cfg.model_dump_json()],
            name="delayline", log=self.run.dir / "delayline.log",
        )
        _wait_for(lambda: ready.exists() or self.delayline.poll() is not None, 10, "delay line start")
        if self.delayline.poll() is not None:
            log = (self.run.dir / "delayline.log").read_text()[-2000:]
            raise BuildError(f"delay line exited with {self.delayline.returncode}: {log}")


def make_backend(name: str, run: runstate.Run) -> NodeBackend:
    if name == "mininet":

        return MininetNodes(run)
    return Pyroute2Nodes(run)


def _backlog_cap(s: Shaping) -> int:
    hold_s = (s.delay_ms + s.jitter_ms) / 1000 + 0.05
    rate = s.rate_bps or 40e9  # unshaped: what the kernel could possibly push (40 Gbit/s)
    return int(rate / 8 * hold_s) + s.queue_bytes


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise BuildError(f"timed out waiting for {what}")
        time.sleep(0.005)
