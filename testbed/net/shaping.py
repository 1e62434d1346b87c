"""Kernel-side link shaping over netlink (pyroute2): htb rate, fifo buffer, netem, offloads.

Every function raises on the first netlink error; the caller (``Network.build``) turns that
into a ``BuildError`` and tears down. Nothing here retries or carries on unshaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pyroute2 import IPRoute
from pyroute2.ethtool import Ethtool
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import plugins as tc_plugins
from pyroute2.netlink.rtnl.tcmsg import sched_pfifo

from testbed.net import netns
from testbed.net.plan import FRAME_OVERHEAD, Shaping

# bfifo shares pfifo's option struct (tc_fifo_qopt: one u32 limit, in bytes for bfifo).
tc_plugins.setdefault("bfifo", sched_pfifo)

# Offloads that make the kernel hand a raw packet socket frames larger than the MTU or with
# checksums left for hardware to fill: both break a userspace forwarder.
OFFLOADS_OFF = (
    "tx-checksum-ip-generic",
    "tx-scatter-gather",
    "tx-tcp-segmentation",
    "tx-tcp6-segmentation",
    "tx-tcp-ecn-segmentation",
    "tx-tcp-mangleid-segmentation",
    "tx-generic-segmentation",
    "tx-udp-segmentation",
    "rx-gro",
)


def _ifindex(ipr: IPRoute, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise NetlinkError(19, f"no interface {ifname}")
    return found[0]


def add_rate_limit(ipr: IPRoute, ifname: str, rate_bps: int, burst: int, queue_bytes: int) -> None:
    """htb root with one class at ``rate_bps`` (ceil = rate) and a byte fifo as its buffer."""
    idx = _ifindex(ipr, ifname)
    ipr.tc("add", "htb", index=idx, handle="1:", default=0x10)
    ipr.tc(
        "add-class", "htb", index=idx, handle="1:10", parent="1:",
        rate=f"{rate_bps}bit", ceil=f"{rate_bps}bit", burst=burst, cburst=burst,
    )  # fmt: skip
    ipr.tc("add", "bfifo", index=idx, handle="10:", parent="1:10", limit=queue_bytes)


@dataclass(frozen=True)
class NetemParams:
    """netem's parameters for one WAN direction (pyroute2 units: microseconds, percent, packets)."""

    delay_us: int
    jitter_us: int
    loss_pct: float
    limit_packets: int
    fifo_child: bool  # a pfifo under netem: jitter without reordering


def netem_params(s: Shaping, mtu: int) -> NetemParams:
    """Under htb, netem's queue is the bottleneck's buffer *and* every frame in flight for the
    delay (plus jitter): its limit, in packets of the WAN frame size, covers ``queue_bytes``
    plus rate x (delay + jitter). Unshaped, only frames in flight are held: netem's default
    (1000). With jitter, netem's time-sorted queue reorders frames that a real line never
    would; a pfifo child makes it release frames in arrival order."""
    frame = mtu + FRAME_OVERHEAD
    if s.rate_bps:
        in_flight = s.rate_bps / 8 * (s.delay_ms + s.jitter_ms) / 1000
        limit = max(1, math.ceil((s.queue_bytes + in_flight) / frame))
    else:
        limit = 1000
    return NetemParams(delay_us=round(s.delay_ms * 1000), jitter_us=round(s.jitter_ms * 1000), loss_pct=s.loss_pct,
                       limit_packets=limit, fifo_child=s.jitter_ms > 0)


def change_rate(ipr: IPRoute, ifname: str, rate_bps: int, burst: int) -> None:
    """Change the htb class of ``add_rate_limit`` (or of the netem layout) in place."""
    ipr.tc(
        "change-class", "htb", index=_ifindex(ipr, ifname), handle="1:10", parent="1:",
        rate=f"{rate_bps}bit", ceil=f"{rate_bps}bit", burst=burst, cburst=burst,
    )  # fmt: skip


def change_netem(ipr: IPRoute, ifname: str, s: Shaping, mtu: int, loss_pct: float | None = None,
                 extra_delay_ms: float = 0.0) -> None:
    """Change the netem qdisc of ``add_wan_qdiscs`` in place: a fault's loss (None: the
    configured loss) and extra delay on top of the direction's shaping."""
    p = netem_params(replace(s, delay_ms=s.delay_ms + extra_delay_ms), mtu)  # room for the extra
    ipr.tc(
        "change", "netem", index=_ifindex(ipr, ifname), handle="10:", parent="1:10" if s.rate_bps else "root",
        delay=p.delay_us, jitter=p.jitter_us,
        loss=p.loss_pct if loss_pct is None else loss_pct, limit=p.limit_packets,
    )  # fmt: skip


def add_wan_qdiscs(ipr: IPRoute, ifname: str, s: Shaping, mtu: int, use_netem: bool) -> None:
    """Egress shaping of one WAN direction.

    netem backend: htb (rate) -> netem (delay, jitter, loss; ``netem_params``) [-> pfifo].
    delay-line backend: htb (rate) -> bfifo (buffer); delay/jitter/loss happen in userspace
    before the frame reaches this qdisc.
    """
    idx = _ifindex(ipr, ifname)
    if not use_netem:
        if s.rate_bps:
            add_rate_limit(ipr, ifname, s.rate_bps, s.burst_bytes, s.queue_bytes)
        return
    parent = "root"
    if s.rate_bps:
        ipr.tc("add", "htb", index=idx, handle="1:", default=0x10)
        ipr.tc(
            "add-class", "htb", index=idx, handle="1:10", parent="1:",
            rate=f"{s.rate_bps}bit", ceil=f"{s.rate_bps}bit", burst=s.burst_bytes, cburst=s.burst_bytes,
        )  # fmt: skip
        parent = "1:10"
    p = netem_params(s, mtu)
    ipr.tc(
        "add", "netem", index=idx, handle="10:", parent=parent,
        delay=p.delay_us, jitter=p.jitter_us, loss=p.loss_pct, limit=p.limit_packets,
    )  # fmt: skip
    if p.fifo_child:
        ipr.tc("add", "pfifo", index=idx, handle="20:", parent="10:", limit=p.limit_packets)


def disable_offloads(ns: str, ifname: str) -> None:
    with netns.entered(ns):
        eth = Ethtool()
        try:
            feats = eth.get_features(ifname)
            for name in OFFLOADS_OFF:
                f = feats.features.get(name)
                if f is not None and f.available:
                    f.enable = False
            eth.set_features(ifname, feats)
        finally:
            eth.close()


def netem_available(ns: str) -> tuple[bool, str]:
    """Try netem on a scratch dummy-less veth inside ``ns`` (a namespace we own)."""
    with netns.iproute(ns) as ipr:
        ipr.link("add", ifname="nmprobe0", kind="veth", peer={"ifname": "nmprobe1"})
        try:
            idx = _ifindex(ipr, "nmprobe0")
            ipr.tc("add", "netem", index=idx, handle="1:", delay=1000)
            return True, "netem qdisc accepted"
        except NetlinkError as e:
            return False, f"netem rejected by the kernel: {e}"
        finally:
            ipr.link("del", ifname="nmprobe0")
