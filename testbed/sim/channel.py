"""One direction of one simulated TCP connection carrying MQTT messages (``bus.py``'s).

Messages arrive in order (TCP), each after the path's latency at the time it was sent
(``LinkModel.latency``: delay, jitter, a saturated line's standing queue); while the path is
down they wait, and go at the connection's first retransmission after it is back. A message
large enough that its bytes matter on the path's slowest link (``BYTES_MATTER_S``) crosses
as a flow of the link model, taking its time and the line's capacity, and what follows it
waits behind it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from testbed.sim.flows import resume_at
from testbed.sim.links import Conn, Link
from testbed.sim.network import LinkModel

# A message whose bytes would hold the path's slowest link this long crosses it as bytes (a
# flow of the link model: it takes its time and the line's capacity); smaller ones only wait
# their latency. A decode command carries its prompt: ~12 KB at token scale 16, 2 % of what
# crossed the default scenario's line beside the KV.
BYTES_MATTER_S = 0.001


@dataclass(frozen=True)
class SimMessage:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


class Channel:
    """One direction of one TCP connection: messages arrive in order, each after the path's
    latency at the time it was sent; while the path is down they wait, and go at the first
    retransmission after it is back. A channel that ``hands_on`` delivers at once with the
    latency still to come (``deliver(item, delay)``): a publisher's channel to the broker,
    whose message the broker routes on with that delay added (one timer per message and
    subscriber, not two)."""

    def __init__(self, links: LinkModel, path: list[Link], conn: Conn, deliver: object,
                 hands_on: bool = False) -> None:
        self.links, self.path, self.conn = links, path, conn
        self.deliver = deliver  # callable(item) (or (item, delay) when it hands on)
        self.hands_on = hands_on
        self.queue: deque[tuple[float | None, object]] = deque()
        self.last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task[None] | None = None
        self.closed = False
        caps = [lk.capacity for lk in path if lk.capacity is not None]
        self._slowest = min(caps) if caps else None  # bytes/s: what a large message's bytes take
        self._sending: deque[tuple[object, float]] = deque()  # behind a large message on the wire
        self._sender: asyncio.Task[None] | None = None

    def put(self, item: object, extra_s: float = 0.0) -> None:
        size = len(item.payload) if isinstance(item, SimMessage) else 0
        large = self._slowest is not None and size / self._slowest >= BYTES_MATTER_S
        if large or self._sending:  # its bytes cross as a flow; what follows waits behind it (TCP)
            self._sending.append((item, extra_s))
            if self._sender is None:
                self._sender = asyncio.ensure_future(self._send())
            return
        self._put(item, extra_s)

    async def _send(self) -> None:
        while self._sending:
            item, extra_s = self._sending[0]
            size = len(item.payload) if isinstance(item, SimMessage) else 0
            if self._slowest is not None and size / self._slowest >= BYTES_MATTER_S:
                await self.links.send(self.conn, size)
            self._sending.popleft()
            if not self.closed:
                self._put(item, extra_s)
        self._sender = None

    def _put(self, item: object, extra_s: float = 0.0) -> None:
        loop = self.links.loop
        if any(lk.down for lk in self.path) or (self.queue and self.queue[-1][0] is None):
            self.queue.append((None, item))  # held until the path is back
            self._wait_up()
            return
        now = loop.time()
        at = max(now + self.links.latency(self.path) + extra_s, self.last)
        if self.hands_on and not self.queue:
            self.last = at
            if not self.closed:
                self.deliver(item, at - now)  # type: ignore[operator]
            return
        self.last = at
        self.queue.append((at, item))
        if self._timer is None:
            self._timer = loop.call_at(at, self._pump)

    def _wait_up(self) -> None:
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.ensure_future(self._resume())

    async def _resume(self) -> None:
        down_since = min((lk.down_since for lk in self.path if lk.down), default=self.links.loop.time())
        await self.links.wait_up(self.path)
        loop = self.links.loop
        resume = resume_at(self.conn, down_since, loop.time())
        held = [(at, item) for at, item in self.queue]
        self.queue.clear()
        for at, item in held:
            if at is None:
                at = max(resume + self.links.latency(self.path), self.last)
                self.last = at
            self.queue.append((at, item))
        if self._timer is None and self.queue:
            self._timer = loop.call_at(self.queue[0][0] or loop.time(), self._pump)

    def _pump(self) -> None:
        self._timer = None
        now = self.links.loop.time()
        while self.queue and self.queue[0][0] is not None and self.queue[0][0] <= now + 1e-12:
            _, item = self.queue.popleft()
            if not self.closed:
                if self.hands_on:
                    self.deliver(item, 0.0)  # type: ignore[operator]
                else:
                    self.deliver(item)  # type: ignore[operator]
        if self.queue and self.queue[0][0] is not None:
            self._timer = self.links.loop.call_at(self.queue[0][0], self._pump)

    def close(self) -> list[object]:
        """Stop; what had not arrived yet."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None
        sending = [item for item, _ in self._sending]
        self._sending.clear()
        if self._waiter is not None:
            self._waiter.cancel()
        left = [item for _, item in self.queue]
        self.queue.clear()
        return left + sending
