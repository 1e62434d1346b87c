"""The link model: the emulated network's links in virtual time, and what faults do to them.

``LinkModel`` builds every link of a (wire) scenario from its network plan (``links.py``),
finds the path between two hosts, prices a small message's crossing (``latency``), carries
transfers' bytes (``send``, by ``flows.Flows``) and applies the faults of a timeline in wire
units (``impair``, ``set_rate``), as the delay line and htb do in the emulation:

* a small message (MQTT, a KV handshake) takes the path's propagation delay, the line's
  jitter (a channel never reorders: ``bus.Channel``), and on a saturated line the standing
  queue of its buffer (``QUEUE_FILL`` of it); over a direction that is down it waits until
  the direction is back;
* a direction that goes down stalls its flows; when it is back each resumes at its
  connection's first retransmission after that (the timeout doubling from ``RTO_MIN_S`` +
  RTT after each one lost: ``flows.resume_at``);
* a loss rate costs flows what the congestion control makes of it (``flows.Flows``); a rate
  change reshapes every flow at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable

from testbed.net.plan import FRAME_OVERHEAD, NetworkPlan
from testbed.scenario import Scenario
from testbed.sim.flows import Flows
from testbed.sim.links import QUEUE_FILL, TCP_IP_HEADERS, Link, Path


class LinkModel:
    """Every link of one (wire) scenario and the flows on them, in the loop's virtual time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sc: Scenario, plan: NetworkPlan, seed: int = 0,
                 congestion: str = "cubic") -> None:
        self.loop = loop
        self.plan = plan
        self.rng = random.Random(seed)
        self.up: dict[str, Link] = {}
        self.downlinks: dict[str, Link] = {}
        self.wan: dict[tuple[str, str], Link] = {}
        self.host_dc = {h.name: h.dc for h in plan.hosts.values()}
        self.host_of_ip = {h.ip: h.name for h in plan.hosts.values()}
        lan_mss = plan.mtu - TCP_IP_HEADERS
        self.lan_mss = lan_mss
        self.wan_mss = plan.wan_frame_mtu - TCP_IP_HEADERS
        for h in plan.hosts.values():
            rate = sc.datacenters[h.dc].lan.rate_mbit
            cap = None if rate is None else rate * 1e6 / 8 * lan_mss / (plan.mtu + FRAME_OVERHEAD)
            self.up[h.name] = self._link(f"{h.name} up", cap)
            self.downlinks[h.name] = self._link(f"{h.name} down", cap)
        for (src, dst), s in plan.wan_shaping.items():
            cap = None if s.rate_bps is None else self._goodput(s.rate_bps)
            self.wan[(src, dst)] = self._link(f"WAN {src}->{dst}", cap, s.delay_ms / 1000, s.jitter_ms / 1000,
                                              s.loss_pct / 100, s.queue_bytes)
            self.wan[(src, dst)].kv_bins = []
        self._paths: dict[tuple[str, str], Path] = {}
        self.watchers: list[Callable[[], None]] = []  # told when a link goes down or comes back
        self.version = 0  # bumped whenever a fault changes a link (paths recompute what they cache)
        self.flows = Flows(self, congestion, random.Random(seed + 1))
        self.send = self.flows.send  # a transfer's bytes (``flows.Flows.send``)
        self.prepare = self.flows.prepare

    def _link(self, name: str, cap: float | None, delay: float = 0.0, jitter: float = 0.0, loss: float = 0.0,
              queue: int = 0) -> Link:
        lk = Link(name, cap, delay, jitter, loss, queue, configured=(cap, delay, loss))
        lk.up_event = asyncio.Event()
        lk.up_event.set()
        return lk

    def _goodput(self, rate_bps: float) -> float:
        mtu = self.plan.wan_frame_mtu
        return rate_bps / 8 * (mtu - TCP_IP_HEADERS) / (mtu + FRAME_OVERHEAD)

    # ----------------------------------------------------------------- paths
    def path(self, src: str, dst: str) -> Path:
        """The links from host ``src`` to host ``dst`` (and back)."""
        key = (src, dst)
        p = self._paths.get(key)
        if p is None:
            p = Path(self._links(src, dst), self._links(dst, src), self._mss(src, dst), _model=self)
            self._paths[key] = p
        return p

    def _links(self, src: str, dst: str) -> list[Link]:
        if src == dst:
            return []
        a, b = self.host_dc[src], self.host_dc[dst]
        return [self.up[src], *([self.wan[(a, b)]] if a != b else []), self.downlinks[dst]]

    def _mss(self, src: str, dst: str) -> int:
        return self.wan_mss if self.host_dc[src] != self.host_dc[dst] else self.lan_mss

    def latency(self, links: Iterable[Link]) -> float:
        """A small message's time over ``links`` now: propagation, jitter, and the standing
        queue of a saturated shaped link (the links must be up)."""
        t = 0.0
        for lk in links:
            t += lk.delay_s
            if lk.jitter_s:
                t += self.rng.uniform(-lk.jitter_s, lk.jitter_s)
            if lk.queue_bytes and lk.capacity and lk.saturated():
                t += QUEUE_FILL[self.flows.congestion] * lk.queue_bytes / lk.capacity
        return max(0.0, t)

    async def wait_up(self, links: Iterable[Link]) -> None:
        """Until every link of ``links`` is up."""
        for lk in links:
            while lk.down:
                assert lk.up_event is not None
                await lk.up_event.wait()

    # ----------------------------------------------------------------- faults (wire units)
    def impair(self, key: tuple[str, str], down: bool = False, loss_pct: float | None = None,
               extra_delay_ms: float = 0.0) -> None:
        """One WAN direction's fault state (the delay line's ``DirectionOverride``): down, a
        loss rate (None: as configured), delay added to the configured one."""
        self.flows.advance()
        self.version += 1
        lk = self.wan[key]
        _, delay0, loss0 = lk.configured
        lk.delay_s = delay0 + extra_delay_ms / 1000
        lk.loss = loss0 if loss_pct is None else loss_pct / 100
        now = self.loop.time()
        changed = down != lk.down
        if down and not lk.down:
            lk.down, lk.down_since = True, now
            assert lk.up_event is not None
            lk.up_event.clear()
        elif not down and lk.down:
            lk.down = False
            assert lk.up_event is not None
            lk.up_event.set()
            for f in self.flows.through(lk):
                self.flows.resumed(f, lk.down_since, now)
        self.flows.reschedule()
        if changed:
            for watch in self.watchers:
                watch()

    def set_rate(self, key: tuple[str, str], rate_bps: float | None) -> None:
        """One WAN direction's rate (wire bits/s); None: back to its configuration."""
        self.flows.advance()
        self.version += 1
        lk = self.wan[key]
        lk.capacity = lk.configured[0] if rate_bps is None else self._goodput(rate_bps)
        self.flows.reschedule()
