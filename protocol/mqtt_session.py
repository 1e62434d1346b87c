"""An MQTT connection that outlives a broker restart, shared by workers, router and client.

``Session`` owns one ``aiomqtt.Client`` (a persistent session: ``clean_session=False`` and
a stable identifier, so a broker that kept its state (``persistence true``) keeps the
subscriptions and queues QoS-1 messages for a component that is reconnecting) and keeps it
connected: when the connection drops it reconnects every ``RETRY_S`` until stopped,
subscribes again and calls ``on_connect`` (which republishes retained state, such as a
worker's status).

What it guarantees about publishing (QoS 1, at least once):

* nothing published while disconnected is lost: paho keeps every unacknowledged QoS-1
  message and sends them, in order, once connected again (``publish`` returns as soon as
  paho holds the message, connected or not);
* a message may arrive twice across a reconnection (QoS 1): readers of token streams skip
  exact repeats (``testbed.load.replay_client``);
* ``held`` counts publishes made while disconnected, ``reconnects`` the reconnections.

What it guarantees about receiving: one message never ends the component. A message over
``MAX_MESSAGE_BYTES`` is refused unread; any exception its handler raises is logged with the
topic and handed to ``on_error`` (which fails the request the message named, if any), and
the session reads on.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import traceback
from collections.abc import Awaitable, Callable

import aiomqtt
import paho.mqtt.client as paho

from protocol import clock
from protocol.messages import MAX_MESSAGE_BYTES, QOS, no_delay
from protocol.refusals import refusal

# What a component does about a message it could not handle: (topic, payload, why).
OnError = Callable[[str, bytes, str], Awaitable[None]]
RETRY_S = 0.2
STOP_GRACE_S = 2.0  # real seconds a stopping component waits to say goodbye to the broker
KEEPALIVE_S = 5.0  # emulated seconds: a worker silent for 1.5x this is announced dead (its will)


def keepalive_for(dilation: float) -> int:
    """The broker keepalive in real seconds: the emulated system's, stretched by the
    dilation (a 4 s outage of the emulated line must not outlast an undilated 5 s
    keepalive just because the host runs it 3x slower)."""
    return max(1, round(KEEPALIVE_S * dilation))


class Session:
    def __init__(self, client: aiomqtt.Client, subscriptions: list[str], name: str) -> None:
        self.client = client
        self.subscriptions = subscriptions
        self.name = name
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.held = 0
        self.reconnected_at: float | None = None  # clock.monotonic() of the last reconnection
        self.losses = 0  # connections lost
        self.on_error: OnError | None = None
        self.refused = 0  # messages refused (too large) or whose handler raised

    @staticmethod
    def client_for(host: str, port: int, username: str, password: str, identifier: str, keepalive: int,
                   will: aiomqtt.Will | None = None) -> aiomqtt.Client:
        client = aiomqtt.Client(host, port, username=username, password=password, identifier=identifier,
                                keepalive=keepalive, will=will, clean_session=False, max_inflight_messages=1000)
        # Publishes are not awaited on the data path, so dozens wait for acknowledgements at
        # once across the WAN: expected, not worth aiomqtt's warning at 10.
        client.pending_calls_threshold = 100_000
        return client

    @staticmethod
    async def discard(host: str, port: int, username: str, password: str, identifier: str) -> None:
        """End whatever session the broker keeps under ``identifier`` (a clean connection,
        closed at once): a worker started again after a crash must not be handed its dead
        predecessor's queued commands, nor leave that session queueing every new one."""
        async with aiomqtt.Client(host, port, username=username, password=password, identifier=identifier,
                                  clean_session=True):
            pass

    def since_reconnect(self) -> float:
        """Seconds since the last reconnection (inf: connected once, never lost)."""
        return float("inf") if self.reconnected_at is None else clock.monotonic() - self.reconnected_at

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Hand a QoS-1 message to paho; waits for the broker's acknowledgement only while
        connected (a caller that must not wait for one spawns this as a task)."""
        try:
            await self.client.publish(topic, payload, qos=QOS, retain=retain)
        except aiomqtt.MqttCodeError as e:
            if e.rc != paho.MQTT_ERR_NO_CONN:
                raise
            self.held += 1  # paho holds it and sends it on reconnection
        except aiomqtt.MqttError:
            # No acknowledgement within the client's timeout (the connection dropped): paho
            # keeps the message and resends it once connected again.
            self.held += 1

    async def run(self, on_message: Callable[[aiomqtt.Message], Awaitable[None]],
                  on_connect: Callable[[bool], Awaitable[None]], stop: asyncio.Event,
                  on_stop: Callable[[], Awaitable[None]] | None = None, first_attempts: int = 50) -> None:
        """Stay connected until ``stop`` is set; ``on_connect(first)`` after each (re)connect,
        ``on_stop`` while still connected at the end. The first connection is tried
        ``first_attempts`` times (a broker that never comes up is an error, raised)."""
        first, attempts = True, 0
        while not stop.is_set():
            try:
                async with self.client as client:
                    no_delay(client)
                    for topic in self.subscriptions:
                        await client.subscribe(topic, qos=QOS)
                    self.connected.set()
                    attempts = 0
                    if not first:
                        self.reconnects += 1
                        self.reconnected_at = clock.monotonic()
                        print(f"{self.name}: reconnected to the broker", file=sys.stderr, flush=True)
                    await on_connect(first)
                    first = False
                    reader = asyncio.create_task(self._read(on_message))
                    stopper = asyncio.create_task(stop.wait())
                    try:
                        await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    except asyncio.CancelledError:  # the component is ending at once: nothing left behind
                        reader.cancel()
                        stopper.cancel()
                        raise
                    stopper.cancel()
                    if stop.is_set():
                        reader.cancel()
                        if on_stop is not None:
                            # Bounded: a broker that went with the orchestrator would hold a
                            # stopping worker for paho's whole timeout (~10 s).
                            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                                await asyncio.wait_for(on_stop(), STOP_GRACE_S)
                        return
                    reader.result()  # raises the connection's error
            except aiomqtt.MqttError as e:
                if self.connected.is_set():
                    self.losses += 1
                self.connected.clear()
                attempts += 1
                if first and attempts >= first_attempts:
                    raise
                if attempts == 1:
                    print(f"{self.name}: broker connection lost or refused ({e}); retrying", file=sys.stderr,
                          flush=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_S)

    async def _read(self, on_message: Callable[[aiomqtt.Message], Awaitable[None]]) -> None:
        async for message in self.client.messages:
            payload = message.payload if isinstance(message.payload, (bytes, bytearray)) else b""
            if len(payload) > MAX_MESSAGE_BYTES:
                await self._refuse(str(message.topic), b"", f"{len(payload)} bytes, more than a message may carry "
                                                            f"({MAX_MESSAGE_BYTES})")
                continue
            try:
                await on_message(message)
            except aiomqtt.MqttError:
                raise  # the connection's, not the message's: reconnect
            except Exception as e:  # noqa: BLE001 - one message's fault ends at most its request
                traceback.print_exception(e, limit=-4, file=sys.stderr)
                await self._refuse(str(message.topic), bytes(payload), f"handling it raised {type(e).__name__}: {e}")

    async def _refuse(self, topic: str, payload: bytes, why: str) -> None:
        self.refused += 1
        refusal(f"{self.name}: refused a message on {topic}: {why}")
        if self.on_error is None:
            return
        try:
            await self.on_error(topic, payload, why)
        except aiomqtt.MqttError:
            raise
        except Exception as e:  # noqa: BLE001 - failing the request failed too: logged, serve on
            print(f"{self.name}: could not fail the request of that message: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
