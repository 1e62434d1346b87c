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
  ``kv_wire.send_kv``'s and ``kv_wire.serve_kv``'s results; their options are one typed set
  each (``KvSend``, ``KvServe``) that both transports take, each field saying what the
  simulator makes of it;
* ``serve_liveness``: a port that only says the process is alive (a prefill's);
* ``probe``: "refused" when nothing listens on a worker's port (the process is gone), "no
  answer" when its host does not answer within ``timeout_s``, else "alive".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiomqtt

from protocol.mqtt_session import Session
from protocol.worker_config import BrokerInfo

if TYPE_CHECKING:  # the KV wire pulls in torch: the router and the command line never need it
    import torch

    from workers import kv_wire
    from workers.kv_stream import Computed


@dataclass(frozen=True)
class KvSend:
    """How one KV transfer is sent, beyond its data: the one set of options both transports
    take. What the simulator makes of each is said beside it; none is dropped unsaid."""

    cancel: asyncio.Event | None = None  # set: the transfer is cut off (both)
    timeout_s: float | None = None  # a peer that takes nothing this long breaks it (both)
    token: str = ""  # the run's KV token, sent as AUTH (both: the simulator prices the frame)
    ticket: str = ""  # the request's ticket, in the HELLO (both: the receiver checks it)
    pool: kv_wire.Connections | None = None  # kept connections; the simulator keeps one per pair of hosts
    zeros: bool = False  # modeled KV, sent as zero blocks; the simulator copies no KV either way
    netns: str | None = None  # the sending host's namespace; the simulator's hosts are its own
    corrupt_block: int | None = None  # a test fault; the simulator refuses a run that sets it (sim/scope.py)
    frame_tokens: int = 0  # tokens per BLOCK frame (0: FRAME_TOKENS); both price the framing by it
    state_bytes: int = 0  # the request's fixed-size state after its KV (a hybrid card's; both send it)
    computed: Computed | None = None  # streamed: when each part of the KV is computed (both); None: all now
    connections: int = 1  # TCP connections the transfer uses at most, each a flow of its own (both)
    layer_groups: int = 1  # streamed per layer: each frame one group of layers, sent as computed (both)


@dataclass(frozen=True)
class KvServe:
    """How a receiver serves KV transfers: the one set of options both transports take."""

    expect: kv_wire.ModelShape | None = None  # the only layout taken; the simulator's senders send it
    token: str = ""  # the run's KV token a connection must open with; the simulator's senders all have it
    zeros: Callable[[int], torch.Tensor] | None = None  # modeled KV: checked, handed on as a zero view (both)
    netns: str | None = None  # listen in that namespace; the simulator's hosts are its own
    timeout_s: float | None = None  # a sender silent this long breaks its transfer (both, by the sender's side)
    max_connections: int = 256  # authenticated connections at once; the simulator's senders keep one each
    state_bytes: int = 0  # the request state a transfer must carry; another size is refused (both)


SEND_DEFAULTS, SERVE_DEFAULTS = KvSend(), KvServe()


class Transport(Protocol):
    def mqtt_client(self, broker: BrokerInfo, identifier: str, keepalive: int,
                    will: aiomqtt.Will | None = None) -> aiomqtt.Client: ...

    async def discard_session(self, broker: BrokerInfo, identifier: str) -> None: ...

    async def send_kv(self, host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor,
                      first_token: int, block_size: int, opts: KvSend = SEND_DEFAULTS) -> kv_wire.TransferStats: ...

    async def serve_kv(self, host: str, port: int, offer: kv_wire.OfferFn, done: kv_wire.DoneFn,
                       fail: kv_wire.FailFn, opts: KvServe = SERVE_DEFAULTS) -> object: ...

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
                      first_token: int, block_size: int, opts: KvSend = SEND_DEFAULTS) -> kv_wire.TransferStats:
        from workers import kv_wire

        return await kv_wire.send_kv(host, port, request_id, tokens, kv, first_token, block_size, cancel=opts.cancel,
                                     corrupt_block=opts.corrupt_block, frame_tokens=opts.frame_tokens,
                                     token=opts.token, ticket=opts.ticket, pool=opts.pool, zeros=opts.zeros,
                                     netns=opts.netns, timeout_s=opts.timeout_s, state_bytes=opts.state_bytes,
                                     computed=opts.computed, connections=opts.connections,
                                     layer_groups=opts.layer_groups)

    async def serve_kv(self, host: str, port: int, offer: kv_wire.OfferFn, done: kv_wire.DoneFn,
                       fail: kv_wire.FailFn, opts: KvServe = SERVE_DEFAULTS) -> object:
        from workers import kv_wire

        return await kv_wire.serve_kv(host, port, offer, done, fail, expect=opts.expect, token=opts.token,
                                      zeros=opts.zeros, netns=opts.netns, timeout_s=opts.timeout_s,
                                      max_connections=opts.max_connections, state_bytes=opts.state_bytes)

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
