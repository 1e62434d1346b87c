"""Network plan: names, interfaces and addresses derived from a scenario and a run prefix.

Layout (one namespace per box)::

    host ns (eth0) --veth-- gw-<dc> (port hN, bridge br0) --veth wan0-- wan (to-<dc> ... to-<dc>)

(on the Mininet backend the gateway's bridge is ``gw-<dc>`` and its ports ``gw-<dc>-ethN``)

* each datacenter has a gateway namespace; its hosts hang off a bridge there, one /24 per
  datacenter (gateway .1, hosts from .10);
* the WAN is its own namespace between the two gateways. It forwards frames between its two
  ports at layer 2 (kernel bridge + netem, or the userspace delay line), so the gateways
  share one /30 and every flow between the datacenters crosses one bottleneck per
  direction. Shaping sits on the WAN namespace's egress ports: ``to-<b>`` carries a->b.

The plan is pure data: computing it touches nothing, so it can be printed and tested.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from testbed.scenario import Scenario, WanDirection

# Ethernet header; the qdisc sees whole frames.
FRAME_OVERHEAD = 14
# Every namespace's TCP memory (net.ipv4.tcp_rmem and tcp_wmem: min, default, max bytes): large
# windows, since a WAN of 1 Gbit/s x 40 ms needs 5 MB in flight, a 10G LAN more.
TCP_MEM = "4096 33554432 134217728"
# What a receiver may advertise at most: half its largest buffer (tcp_adv_win_scale 1, the
# kernel's default, keeps the other half for its bookkeeping).
RECEIVE_WINDOW_BYTES = int(TCP_MEM.split()[2]) // 2
# htb cannot enforce a rate finer than the kernel timer; one tick's worth must fit the bucket.
TIMER_GRANULARITY_S = 0.001


@dataclass(frozen=True)
class HostPlan:
    name: str
    dc: str
    ns: str
    ip: str
    gw_port: str


@dataclass(frozen=True)
class DcPlan:
    name: str
    gw_ns: str
    subnet: ipaddress.IPv4Network
    gw_lan_ip: str
    gw_wan_ip: str
    wan_port: str  # interface name of this datacenter's side inside the WAN namespace
    bridge: str  # the gateway's bridge, which carries its LAN address
    lan_rate_mbit: float | None


@dataclass(frozen=True)
class Shaping:
    """Kernel queueing parameters for one WAN direction, sized from its rate and RTT."""

    rate_bps: int | None
    burst_bytes: int
    queue_bytes: int
    delay_ms: float
    jitter_ms: float
    loss_pct: float


@dataclass(frozen=True)
class NetworkPlan:
    prefix: str
    mtu: int
    wan_ns: str
    hosts: dict[str, HostPlan]
    dcs: dict[str, DcPlan]
    wan_between: tuple[str, str]
    wan_shaping: dict[tuple[str, str], Shaping]  # (src_dc, dst_dc) -> shaping
    wan_mtu: int = 0  # 0 = mtu
    backend: str = "pyroute2"  # who creates nodes and links (testbed/net/nodes.py)

    @property
    def wan_frame_mtu(self) -> int:
        return self.wan_mtu or self.mtu

    def bdp_frames(self, src: str, dst: str) -> float | None:
        """Frames in flight to fill the ``src -> dst`` line for one round trip (None: unshaped)."""
        s, r = self.wan_shaping[(src, dst)], self.wan_shaping[(dst, src)]
        if not s.rate_bps:
            return None
        rtt_s = (s.delay_ms + r.delay_ms) / 1000
        return s.rate_bps / 8 * rtt_s / (self.wan_frame_mtu + FRAME_OVERHEAD)

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts.values()] + [d.gw_ns for d in self.dcs.values()] + [self.wan_ns]


def size_shaping(d: WanDirection, reverse: WanDirection, mtu: int) -> Shaping:
    """Size the htb bucket and the bottleneck buffer for one direction.

    Fixed defaults wreck long-delay links (Mininet's 15 KB burst, netem's 1000 packets), so:
    burst = max(2 frames, rate x 1 timer tick); queue = max(4 frames, rate x path RTT),
    where the RTT counts both directions' delay plus jitter (one bandwidth-delay product,
    what a TCP flow needs to keep the line busy).
    """
    frame = mtu + FRAME_OVERHEAD
    rate_bps = int(d.rate_mbit * 1e6) if d.rate_mbit else None
    if rate_bps:
        burst = max(2 * frame, math.ceil(rate_bps / 8 * TIMER_GRANULARITY_S))
        rtt_s = (d.delay_ms + d.jitter_ms + reverse.delay_ms + reverse.jitter_ms) / 1000
        bdp = math.ceil(rate_bps / 8 * rtt_s)
        queue = d.queue_bytes or max(4 * frame, bdp)
    else:
        burst = 2 * frame
        queue = d.queue_bytes or 64 * 1024 * 1024
    return Shaping(rate_bps, burst, queue, d.delay_ms, d.jitter_ms, d.loss_pct)


def size_lan(rate_bps: int, mtu: int) -> Shaping:
    """Shaping for an intra-datacenter link: no delay, buffer of 2 ms at line rate."""
    frame = mtu + FRAME_OVERHEAD
    burst = max(2 * frame, math.ceil(rate_bps / 8 * TIMER_GRANULARITY_S))
    queue = max(8 * frame, math.ceil(rate_bps / 8 * 0.002))
    return Shaping(rate_bps, burst, queue, 0.0, 0.0, 0.0)


def make_plan(scenario: Scenario, prefix: str) -> NetworkPlan:
    net = scenario.network.subnet
    base = int(net.network_address)
    hosts: dict[str, HostPlan] = {}
    dcs: dict[str, DcPlan] = {}
    wan_net = ipaddress.IPv4Network((base, 30))
    wan_ips = [str(ip) for ip in wan_net.hosts()]
    mininet = scenario.network.backend == "mininet"
    for i, (dc_name, dc) in enumerate(scenario.datacenters.items()):
        subnet = ipaddress.IPv4Network((base + (i + 1) * 256, 24))
        # Mininet's LinuxBridge is named after its node and takes the ports named after it
        # (gw-a-eth1, ...: a Mininet switch's ports count from 1).
        bridge = f"gw-{dc_name}" if mininet else "br0"
        dcs[dc_name] = DcPlan(
            name=dc_name,
            gw_ns=f"{prefix}-gw-{dc_name}",
            subnet=subnet,
            gw_lan_ip=str(subnet.network_address + 1),
            gw_wan_ip=wan_ips[i],
            wan_port=f"to-{dc_name}",
            bridge=bridge,
            lan_rate_mbit=dc.lan.rate_mbit,
        )
        for j, host in enumerate(dc.hosts):
            if j + 10 > 250:
                raise ValueError(f"datacenter {dc_name} has more than 240 hosts")
            hosts[host] = HostPlan(
                name=host,
                dc=dc_name,
                ns=f"{prefix}-{host}",
                ip=str(subnet.network_address + 10 + j),
                gw_port=f"{bridge}-eth{j + 1}" if mininet else f"h{j}",
            )
    a, b = scenario.wan.between
    mtu = scenario.network.mtu
    wan_mtu = min(scenario.network.wan_mtu or mtu, mtu)
    shaping = {
        (a, b): size_shaping(scenario.wan.forward, scenario.wan.reverse, wan_mtu),
        (b, a): size_shaping(scenario.wan.reverse, scenario.wan.forward, wan_mtu),
    }
    return NetworkPlan(prefix, mtu, f"{prefix}-wan", hosts, dcs, (a, b), shaping, wan_mtu,
                       scenario.network.backend)
