"""How a component reaches the others: the broker and its KV peers.

Workers, the router and the replay client never open a connection themselves; they ask the
``Transport`` they were given. ``HOST`` is the real one (MQTT over TCP to mosquitto, KV over
TCP between namespaces: ``protocol/mqtt_session.py``, ``workers/kv_wire.py``); the simulator
(``testbed/sim/``) hands every component one of its own, whose broker and links are models
in virtual time. Each method states one contract, whatever carries it:

* ``mqtt_client``: an ``aiomqtt.Client``-shaped connection for ``Session`` (async context
  manager, ``subscribe``, ``publish``, ``messages``; ``aiomqtt.MqttError`` when it drops);
* ``discard_session``: end whatever session the broker keeps under an identifier;
* ``send_kv`` / ``serve_kv``: one KV transfer, sender and receiver side, with
  ``kv_wire.send_kv``'s and ``kv_wire.serve_kv``'s arguments and results;
* ``serve_liveness``: a port that only says the process is alive (a prefill's);
* ``probe``: "refused" when nothing listens on a worker's port (the process is gone), "no
  answer" when its host does not answer within ``timeout_s``, else "alive".
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import aiomqtt

from protocol.mqtt_session import Session
from protocol.worker_config import BrokerInfo

if TYPE_CHECKING:  # the KV wire pulls in torch: the router and the command line never need it
    import torch

    from workers import kv_wire


class Transport(Protocol):
    def mqtt_client(self, broker: BrokerInfo, identifier: str, keepalive: int,
                    will: aiomqtt.Will | None = None) -> aiomqtt.Client: ...

    async def discard_session(self, broker: BrokerInfo, identifier: str) -> None: ...

    async def send_kv(self, host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor,
                      first_token: int, block_size: int, **options: Any) -> kv_wire.TransferStats: ...

    async def serve_kv(self, host: str, port: int, offer: kv_wire.OfferFn, done: kv_wire.DoneFn,
                       fail: kv_wire.FailFn, **options: Any) -> object: ...

    async def serve_liveness(self, host: str, port: int, netns: str | None) -> object: ...

    async def probe(self, host: str, port: int, timeout_s: float) -> str: ...


class HostTransport:
    """The real network: mosquitto and TCP, from the namespace the caller runs in."""

    def mqtt_client(self, broker: BrokerInfo, identifier: str, keepalive: int,
                    will: aiomqtt.Will | None = None) -> aiomqtt.Client:
        return Session.client_for(broker.host, broker.port, broker.username, broker.password, identifier,
                                  keepalive=keepalive, will=will)

    async def discard_session(self, broker: BrokerInfo, identifier: str) -> None:
        await Session.discard(broker.host, broker.port, broker.username, broker.password, identifier)

    async def send_kv(self, host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor,
                      first_token: int, block_size: int, **options: Any) -> kv_wire.TransferStats:
        from workers import kv_wire

        return await kv_wire.send_kv(host, port, request_id, tokens, kv, first_token, block_size, **options)

    async def serve_kv(self, host: str, port: int, offer: kv_wire.OfferFn, done: kv_wire.DoneFn,
                       fail: kv_wire.FailFn, **options: Any) -> object:
        from workers import kv_wire

        return await kv_wire.serve_kv(host, port, offer, done, fail, **options)

    async def serve_liveness(self, host: str, port: int, netns: str | None) -> object:
        from workers import kv_conn

        return await kv_conn.serve_liveness(host, port, netns)

    async def probe(self, host: str, port: int, timeout_s: float) -> str:
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            return "refused"
        except (OSError, TimeoutError):
            return "no answer"
        writer.close()
        return "alive"


HOST: Transport = HostTransport()
