"""The parts of the link model: links, paths, connections and flows, as data.

The emulation moves real bytes through namespaces, an htb class per WAN direction (the
rate, a byte fifo as the bottleneck buffer), the userspace delay line (delay, jitter, loss,
faults) and the LAN shaping of every host's port (``testbed/net/``). The simulator models
the same network from the same wire scenario and network plan (``network.LinkModel``):

* **Links.** Every host has an uplink and a downlink at its datacenter's LAN rate (no
  delay); each WAN direction has the line's rate, delay, jitter, loss and buffer. A path
  from host to host is the sender's uplink, the WAN direction if the datacenters differ,
  and the receiver's downlink. Capacities are goodput: the rate times the share of a frame
  that is TCP payload at the path's MTU.
* **Connections** keep a TCP connection's state between transfers: established or not,
  its congestion window, when it was last active (``flows.Flows`` grows and restarts it).
* **Flows** are a transfer's bytes in progress over a connection's path.

What only the emulation shows: real TCP (its congestion control's sawtooth, retransmission
details, kernel buffers), the delay line's own lateness, the host's ceiling on bytes per
second. ``testbed validate`` measures how far apart the two are.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Protocol

from testbed.net.line_tap import KV_BIN_S  # the delay line's bins: the two engines' counters line up
from testbed.net.plan import RECEIVE_WINDOW_BYTES

TCP_IP_HEADERS = 52  # IPv4 20 + TCP 20 + timestamps 12: what a segment carries beyond its payload
INITIAL_WINDOW = 10.0  # segments (RFC 6928, Linux's default); windows are floats: they only grow to a bound
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout
RTO_MAX_S = 120.0
MATHIS_C = 1.22
# How many of a saturated line's buffers a small message waits behind, by congestion control:
# BBR measured here (``testbed bench links``: 43 ms beside a full 16 Mbit/s line whose buffer
# drains in 31 ms; the delay line holds some too); CUBIC's sawtooth is taken to average 3/4.
QUEUE_FILL = {"bbr": 1.4, "cubic": 0.75}
# Competing TCP flows through a small buffer are not fair in the short run: of 10 or 40
# equal transfers started at once, the first ended at half (a quarter) of the time the last
# did, and on average at 0.83 of it; two ended together (``testbed bench links``). Each flow
# draws a weight from SHARE_WEIGHTS (the model's seeded generator), and a link shares by
# weight spread in proportion to the flows crossing it: none with one, all of it from
# 1 + UNFAIR_FLOWS (mean completion 0.80-0.82 of the last).
SHARE_WEIGHTS = (0.2, 1.8)
UNFAIR_FLOWS = 8
# Over minutes the kernel's flows converge to equal shares: ten transfers held behind a
# saturated line for ten minutes ended together at its end (``bench links --held 600``), where
# weights kept for life ended them 18 % early on average. A flow keeps its drawn spread for
# its first SHARE_STEADY_S (the short-run measurements above lie within it), then the spread
# decays by e every SHARE_CONVERGE_S of age; the rates are re-weighed every SHARE_REWEIGH_S
# while a crowded flow's spread is decaying.
SHARE_STEADY_S = 10.0
SHARE_CONVERGE_S = 30.0
SHARE_REWEIGH_S = 5.0
# BBR re-measures its minimum RTT when none was seen for 10 s: 200 ms and a round trip with
# 4 segments in flight (Linux's PROBE_RTT); a transfer of many seconds runs ~2 % slower.
BBR_MIN_RTT_S, BBR_PROBE_RTT_S, BBR_PROBE_SEGMENTS = 10.0, 0.2, 4


class Versioned(Protocol):
    version: int  # bumped whenever a fault changes a link


def spread(bins: list[float], t_from: float, t_to: float, nbytes: float) -> None:
    """Add ``nbytes``, moved at a constant rate over [``t_from``, ``t_to``), to ``bins`` (bin
    ``i`` covers loop time [i, i + 1) x ``KV_BIN_S``)."""
    if t_to <= t_from:
        t_to = t_from + 1e-12
    rate = nbytes / (t_to - t_from)
    i = int(t_from / KV_BIN_S)
    t = t_from
    while t < t_to:
        edge = min((i + 1) * KV_BIN_S, t_to)
        if i >= len(bins):
            bins.extend([0.0] * (i + 1 - len(bins)))
        bins[i] += rate * (edge - t)
        t, i = edge, i + 1


@dataclass(eq=False)
class Link:
    name: str
    capacity: float | None  # payload bytes per second; None: unshaped
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0  # probability a segment is lost
    queue_bytes: int = 0
    configured: tuple[float | None, float, float] = (None, 0.0, 0.0)  # capacity, delay, loss as built
    down: bool = False
    down_since: float = 0.0
    flows: dict[Flow, None] = field(default_factory=dict)  # on it now (an ordered set: runs repeat exactly)
    up_event: asyncio.Event | None = None  # set while the link is up (small messages wait on it)
    busy_bytes: float = 0.0  # payload bytes that crossed (what the link carried)
    kv_bins: list[float] | None = None  # KV payload bytes per KV_BIN_S of loop time (the WAN's links)

    def saturated(self) -> bool:
        if self.capacity is None or not self.flows:
            return False
        return sum(f.rate for f in self.flows) >= 0.999 * self.capacity


@dataclass(eq=False)
class Conn:
    """One TCP connection's state between transfers (a KV sender keeps its connection to a
    receiver open, ``workers/kv_wire.py``)."""

    path: Path
    established: bool = False
    cwnd: float = INITIAL_WINDOW  # segments
    ssthresh: float = math.inf
    last_active: float = -math.inf
    probe_due: float = math.inf  # BBR: when its minimum RTT expires and it probes for it again
    probing_until: float = -math.inf  # BBR: in PROBE_RTT until then (4 segments in flight)
    kv: bool = False  # a KV connection: its bytes are counted per bin on the links that count them
    busy: bool = False  # a transfer is on it (another one to the same port takes another connection)

    @property
    def rto_s(self) -> float:
        """The retransmission timeout of an idle connection (Linux: RTT + at least 200 ms)."""
        return min(RTO_MAX_S, RTO_MIN_S + self.path.rtt_s)


@dataclass(eq=False)
class Path:
    links: list[Link]
    back: list[Link]  # the reverse path (acknowledgements, answers)
    mss: int
    # What the links say now, kept until a fault changes a link (``LinkModel.version``).
    _seen: int = -1
    _rtt: float = 0.0
    _bottleneck: float | None = None
    _loss: float = 0.0
    _max_cwnd: float = INITIAL_WINDOW
    _model: Versioned | None = None

    def _fresh(self) -> None:
        assert self._model is not None
        if self._seen == self._model.version:
            return
        self._seen = self._model.version
        self._rtt = sum(lk.delay_s for lk in self.links) + sum(lk.delay_s for lk in self.back)
        caps = [lk.capacity for lk in self.links if lk.capacity is not None]
        self._bottleneck = min(caps) if caps else None
        self._loss = 1 - math.prod(1 - lk.loss for lk in self.links)
        # A window never outgrows what the receiver advertises (the namespaces' TCP memory),
        # nor what the path holds: its bandwidth-delay product plus its buffers (past that,
        # what a sender adds is dropped at the bottleneck's queue, and the window shrinks).
        held = RECEIVE_WINDOW_BYTES
        if self._bottleneck is not None:
            held = min(held, self._bottleneck * self._rtt + sum(lk.queue_bytes for lk in self.links
                                                                if lk.capacity is not None))
        self._max_cwnd = max(INITIAL_WINDOW, held / self.mss)

    @property
    def rtt_s(self) -> float:
        self._fresh()
        return self._rtt

    @property
    def bottleneck(self) -> float | None:
        self._fresh()
        return self._bottleneck

    @property
    def loss(self) -> float:
        self._fresh()
        return self._loss

    @property
    def max_cwnd(self) -> float:
        """The largest congestion window (segments) a connection on this path reaches."""
        self._fresh()
        return self._max_cwnd

    def down(self) -> bool:
        return any(lk.down for lk in self.links) or any(lk.down for lk in self.back)


@dataclass
class Origin:
    """A streamed transfer's identity across its bursts (``Flows.send``): one TCP connection's
    transfer keeps its start and its drawn share while its bytes come burst by burst."""

    born: float | None = None  # None: set by the first burst
    draw: float = 1.0


@dataclass(eq=False)
class Flow:
    """A transfer's bytes in progress over a connection's path (``flows.Flows``)."""

    conn: Conn
    size: float
    seq: int  # the order flows started in: every tie is broken by it
    done: asyncio.Future[None]
    timeout_s: float | None = None  # a flow that moves nothing this long fails (TimeoutError)
    sent: float = 0.0
    rate: float = 0.0
    draw: float = 1.0  # its weight when a link is crowded (``SHARE_WEIGHTS``), while young
    born: float = 0.0  # when it started (its spread decays with age: ``SHARE_CONVERGE_S``)
    spread: float = 0.0  # its weight's spread from 1 on its most crowded link, before the decay
    weight: float = 1.0  # its share of a link against the others' now
    cap: float = 0.0  # what it could carry alone (``window``, and the loss limit)
    window: float = 0.0  # its congestion window over the round trip, bytes/s
    stalled_until: float = 0.0  # waiting for a retransmission timer after an outage
    next_ramp: float = math.inf  # when its window doubles (inf: not window-limited)
    idle_since: float | None = None  # when it last stopped moving

    @property
    def remaining(self) -> float:
        return self.size - self.sent
