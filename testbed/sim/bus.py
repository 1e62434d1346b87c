"""The broker, modeled: MQTT as the components see it, over the link model, in virtual time.

Every component keeps its own ``protocol.mqtt_session.Session`` (reconnection, the guard on
each message, publishing while disconnected); the simulator only replaces what it connects
to. ``SimClient`` has the part of ``aiomqtt.Client``'s interface a session uses (an async
context manager that connects, ``subscribe``, ``publish``, ``messages``; ``aiomqtt.MqttError``
when the connection drops); ``SimBroker`` is mosquitto as the testbed configures it:

* one broker on the router's host; a message takes the publisher's path to it, a constant
  ``HOP_S`` inside it, and each subscriber's path from it, in order per connection and
  direction (``channel.Channel``: latency, a large message's bytes, a path that is down);
* QoS 1 with persistent sessions: a client's subscriptions and the messages for it outlive
  its connection (queued while it is away, delivered when it is back); what a client
  published and the broker had not received when its connection dropped is sent again
  after it reconnects (at least once); retained messages are kept per topic and delivered
  on subscribe;
* last wills: published when a connection ends without a goodbye (a killed component), when
  a path stays down past 1.5 keepalives (the broker gives up on it; the client, whose pings
  go unanswered, too) and, as mosquitto does, for every client when the broker stops;
* ``stop`` / ``start``: a broker restart; while it is down connections are refused at once.

Not modeled: the ACL (every simulated component is ours), message sizes on the line (control
messages are small beside KV), the broker's CPU.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiomqtt
import paho.mqtt.client as paho

from testbed.sim.channel import Channel, SimMessage
from testbed.sim.links import Conn
from testbed.sim.network import LinkModel

HOP_S = 0.0002  # a message's time inside the broker (mosquitto, measured: 0.42 ms for a round trip through it)
KEEPALIVE_FACTOR = 1.5  # a connection silent this many keepalives is given up (MQTT 3.1.1)
CONNECT_TIMEOUT_S = 10.0  # aiomqtt's default


def matches(pattern: str, topic: str) -> bool:
    """MQTT topic filter matching (``+`` one level, ``#`` the rest)."""
    if pattern == topic:
        return True
    p, t = pattern.split("/"), topic.split("/")
    for i, part in enumerate(p):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(p) == len(t)


@dataclass(eq=False)
class _BrokerSession:
    """What the broker keeps for one client identifier (persistent: outlives connections)."""

    identifier: str
    subs: list[str] = field(default_factory=list)
    queued: deque[SimMessage] = field(default_factory=deque)
    connection: _Connection | None = None


@dataclass(eq=False)
class _Connection:
    client: SimClient
    session: _BrokerSession
    up: Channel  # client -> broker
    down: Channel  # broker -> client
    inbox: asyncio.Queue[SimMessage | None] = field(default_factory=asyncio.Queue)
    open: bool = True
    watchdog: asyncio.TimerHandle | None = None  # set while its path is down: when it is given up


class SimBroker:
    def __init__(self, links: LinkModel, host: str) -> None:
        self.links = links
        self.host = host
        self.up = True
        self.sessions: dict[str, _BrokerSession] = {}
        self.retained: dict[str, bytes] = {}
        self.delivered = 0
        self._subscribed: dict[str, list[_BrokerSession]] = {}  # topic -> sessions subscribed (a cache)
        links.watchers.append(self._links_changed)

    def client(self, host: str, identifier: str, keepalive: float, will: aiomqtt.Will | None) -> SimClient:
        return SimClient(self, host, identifier, keepalive, will)

    def discard(self, identifier: str) -> None:
        """A clean connection under ``identifier``: its persistent session ends."""
        s = self.sessions.pop(identifier, None)
        self._subscribed.clear()
        if s is not None and s.connection is not None:
            self._drop(s.connection, will=False)

    # ----------------------------------------------------------------- routing
    def route(self, msg: SimMessage, delay: float = 0.0) -> None:
        """A message the broker receives ``delay`` from now (what is left of its way from
        the publisher): retained if asked, then to every session that subscribed to its
        topic (queued for those whose client is away)."""
        if not self.up:
            return
        if msg.retain:
            if msg.payload:
                self.retained[msg.topic] = msg.payload
            else:
                self.retained.pop(msg.topic, None)
        out = SimMessage(msg.topic, msg.payload, msg.qos, False)
        subscribed = self._subscribed.get(msg.topic)
        if subscribed is None:
            subscribed = [s for s in self.sessions.values() if any(matches(p, msg.topic) for p in s.subs)]
            self._subscribed[msg.topic] = subscribed
        for s in subscribed:
            if s.connection is not None and s.connection.open:
                s.connection.down.put(out, delay + HOP_S)
            else:
                s.queued.append(out)

    def _arrive(self, conn: _Connection, msg: SimMessage | None) -> None:
        """A message reached the client's side of its connection."""
        if conn.open:
            self.delivered += 1
            conn.inbox.put_nowait(msg)

    # ----------------------------------------------------------------- connections
    def _attach(self, client: SimClient) -> _Connection:
        s = self.sessions.get(client.identifier)
        if s is None:
            s = self.sessions[client.identifier] = _BrokerSession(client.identifier)
            self._subscribed.clear()
        if s.connection is not None:  # a new connection under an identifier takes the session over
            self._drop(s.connection, will=False)
        path = self.links.path(client.host, self.host)
        conn = _Connection(client, s, None, None)  # type: ignore[arg-type]
        back = self.links.path(self.host, client.host)
        conn.up = Channel(self.links, path.links, Conn(path, established=True), self.route, hands_on=True)
        conn.down = Channel(self.links, back.links, Conn(back, established=True), lambda m: self._arrive(conn, m))
        s.connection = conn
        while s.queued:  # what came while it was away, in order
            conn.down.put(s.queued.popleft(), HOP_S)
        self._watch(conn)
        return conn

    def _links_changed(self) -> None:
        for s in self.sessions.values():
            if s.connection is not None and s.connection.open:
                self._watch(s.connection)

    def _watch(self, conn: _Connection) -> None:
        """A connection whose path is down is given up 1.5 keepalives after it went down:
        the will goes out, and the client (its pings unanswered) sees the connection drop."""
        path = self.links.path(conn.client.host, self.host)
        down = [lk.down_since for lk in (*path.links, *path.back) if lk.down]
        if not down:
            if conn.watchdog is not None:
                conn.watchdog.cancel()
                conn.watchdog = None
            return
        if conn.watchdog is None:
            at = min(down) + KEEPALIVE_FACTOR * conn.client.keepalive
            conn.watchdog = self.links.loop.call_at(max(at, self.links.loop.time()), self._drop, conn, True)

    def _drop(self, conn: _Connection, will: bool) -> None:
        """End a connection: what the client had sent and the broker not yet received goes
        back to the client (paho resends it); what the broker had not delivered is queued
        in the session again; with ``will`` the client's last will is published."""
        if not conn.open:
            return
        conn.open = False
        if conn.watchdog is not None:
            conn.watchdog.cancel()
        unsent = conn.up.close()
        undelivered = conn.down.close()
        conn.client.resend[:0] = [m for m in unsent if isinstance(m, SimMessage)]
        conn.session.queued.extendleft(reversed([m for m in undelivered if isinstance(m, SimMessage)]))
        if conn.session.connection is conn:
            conn.session.connection = None
        conn.inbox.put_nowait(None)  # the client's reader sees the connection end
        w = conn.client.will
        if will and w is not None and self.up:
            payload = w.payload if isinstance(w.payload, bytes) else str(w.payload or "").encode()
            self.route(SimMessage(w.topic, payload, w.qos, w.retain))

    def stop(self) -> None:
        """The broker stops (a restart's first half): every client's will, then every
        connection dropped; sessions and retained messages are kept (persistence)."""
        live = [s.connection for s in self.sessions.values() if s.connection is not None]
        for conn in live:
            w = conn.client.will
            if w is not None:
                payload = w.payload if isinstance(w.payload, bytes) else str(w.payload or "").encode()
                self.route(SimMessage(w.topic, payload, w.qos, w.retain))
        for conn in live:
            self._drop(conn, will=False)
        self.up = False

    def start(self) -> None:
        self.up = True


class SimClient:
    """What a ``Session`` connects through, in place of ``aiomqtt.Client``."""

    def __init__(self, broker: SimBroker, host: str, identifier: str, keepalive: float,
                 will: aiomqtt.Will | None) -> None:
        self.broker, self.host, self.identifier = broker, host, identifier
        self.keepalive, self.will = keepalive, will
        self.conn: _Connection | None = None
        self.resend: list[SimMessage] = []  # published while away: sent on the next connection
        self.pending_calls_threshold = 0

    async def __aenter__(self) -> SimClient:
        links, b = self.broker.links, self.broker
        path = links.path(self.host, b.host)
        loop = links.loop
        deadline = loop.time() + CONNECT_TIMEOUT_S
        if path.down():
            try:
                async with asyncio.timeout_at(deadline):
                    await links.wait_up([*path.links, *path.back])
            except TimeoutError:
                raise aiomqtt.MqttError("connection timed out") from None
        await asyncio.sleep(links.latency(path.links) + links.latency(path.back))  # CONNECT, CONNACK
        if not b.up or path.down():
            raise aiomqtt.MqttError("Connection refused")
        self.conn = b._attach(self)
        for m in self.resend:
            self.conn.up.put(m)
        self.resend.clear()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """A clean disconnect: no will."""
        if self.conn is not None and self.conn.open:
            self.broker._drop(self.conn, will=False)
        self.conn = None

    def kill(self) -> None:
        """The process ended without a goodbye: the broker publishes its will."""
        if self.conn is not None and self.conn.open:
            self.broker._drop(self.conn, will=True)
        self.conn = None

    async def subscribe(self, topic: str, qos: int = 1) -> None:
        conn = self._connected()
        if topic not in conn.session.subs:
            conn.session.subs.append(topic)
            self.broker._subscribed.clear()
        for t, payload in list(self.broker.retained.items()):
            if matches(topic, t):
                conn.down.put(SimMessage(t, payload, qos, True), HOP_S)

    async def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        msg = SimMessage(topic, bytes(payload), qos, retain)
        conn = self.conn
        if conn is None or not conn.open:
            self.resend.append(msg)
            raise aiomqtt.MqttCodeError(paho.MQTT_ERR_NO_CONN, "not connected")
        conn.up.put(msg)

    def _connected(self) -> _Connection:
        if self.conn is None or not self.conn.open:
            raise aiomqtt.MqttCodeError(paho.MQTT_ERR_NO_CONN, "not connected")
        return self.conn

    @property
    def messages(self) -> AsyncIterator[SimMessage]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[SimMessage]:
        conn = self._connected()
        while True:
            msg = await conn.inbox.get()
            if msg is None or not conn.open:
                raise aiomqtt.MqttError("connection lost")
            yield msg

