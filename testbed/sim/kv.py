"""KV connections, modeled: the KV wire's exchange over the link model, in virtual time.

A real transfer (``workers/kv_wire.py``) is HELLO (the prompt's token ids; on a fresh
connection after AUTH, the run's token) -> OFFER (how much the receiver holds) -> BLOCK
frames of what it lacks -> END -> ACK, over a TCP connection the sender keeps to each
receiver. ``SimTransport.send_kv`` follows the same exchange with the
same bytes (frame headers included, so the WAN bytes of a run equal the emulation's) and
calls the receiver's own callbacks at the times their frames would arrive: ``offer`` (the
decoder's ``_offer``: its DRC lookup, its wait for the request's command), ``done`` (its
``_arrived``: admission, caching, the handoff), ``fail`` (its ``_transfer_failed``).

Transport semantics kept from the wire: a receiver that refuses the offer fails the request
on both sides (only on the sender's, when the receiver refused a sender without the
request's ticket: its ``_offer`` checks the ticket here as on the wire); a cut-off
(``cancel``) resets the connection at once (the receiver sees the reset after the path's
delay; the sender counts what the receiver had acknowledged); a
transfer that moves nothing for ``timeout_s`` (its path is down) breaks; a receiver that dies
resets its transfers; a connection is kept between clean transfers (``links.Conn``) and
replaced after a broken one. Not kept: the frames' checks (every simulated peer is ours),
the run's token in AUTH and HELLO, the connection limit.

``SimTransport`` is one host's ``workers.transport.Transport``: the broker through
``SimBroker``, KV and liveness ports through the registry of ``SimNet``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
import torch

from protocol import clock
from protocol.kv_format import (
    BLOCK_HDR,
    FRAME_TOKENS,
    HDR,
    STATE_FRAME,
    Auth,
    End,
    Hello,
    KVRefused,
    KVTransferError,
)
from protocol.worker_config import BrokerInfo
from testbed.sim import kv_stripes
from testbed.sim.bus import SimBroker, SimClient
from testbed.sim.links import Conn
from testbed.sim.network import LinkModel
from workers.kv_stream import LayerOrder
from workers.kv_wire import DoneFn, FailFn, Incoming, OfferFn, TransferStats
from workers.transport import SEND_DEFAULTS, SERVE_DEFAULTS, KvSend, KvServe

HELLO_SAMPLE = 256  # token ids whose digits are counted to size a HELLO (the rest are like them)


@dataclass(eq=False)
class _Listener:
    host: str
    offer: OfferFn | None = None  # None: a liveness port (a prefill's)
    done: DoneFn | None = None
    fail: FailFn | None = None
    zeros: Callable[[int], torch.Tensor] | None = None
    state_bytes: int = 0  # the request state every transfer must carry (``KvServe.state_bytes``)
    open: bool = True
    aborts: set[asyncio.Event] = field(default_factory=set)  # transfers in progress: reset when it closes

    def close(self) -> None:
        self.open = False
        for ev in self.aborts:
            ev.set()


class SimNet:
    """What the components of one simulated deployment share: the links, the broker, the
    listening ports."""

    def __init__(self, links: LinkModel, broker: SimBroker) -> None:
        self.links, self.broker = links, broker
        self.listeners: dict[tuple[str, int], _Listener] = {}
        # Per sender host and receiver port, the connections kept (more than one while transfers run side by side).
        self.conns: dict[tuple[str, str, int], list[Conn]] = {}
        self.clients: dict[str, list[SimClient]] = {}  # host -> its MQTT clients
        self._tasks: set[asyncio.Task[Any]] = set()  # receivers' callbacks in progress

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a receiver's callback as the receiver would: in a task of its own."""
        task = asyncio.ensure_future(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def transport(self, host: str) -> SimTransport:
        return SimTransport(self, host)

    def kill_host(self, host: str) -> None:
        """The process on ``host`` is gone: its ports close (transfers reset, probes
        refused) and its broker connections end without a goodbye (its will goes out)."""
        for lst in self.listeners.values():
            if lst.host == host:
                lst.close()
        for c in self.clients.pop(host, []):
            c.kill()
        for key in [k for k in self.conns if k[0] == host]:
            for conn in self.conns[key]:
                conn.established = False


def hello_bytes(rid: str, tokens: list[int], shape: tuple[int, int, int], dtype: torch.dtype, block_size: int,
                token: str, ticket: str, state_bytes: int = 0, stripes: int = 1, layer_groups: int = 1) -> int:
    """The HELLO frame's size: its JSON with the token ids' digits counted on a sample."""
    layers, heads, head_dim = shape
    empty = Hello.model_construct(rid=rid, tokens=[], dtype=str(dtype), layers=layers, kv_heads=heads,
                                  head_dim=head_dim, block_size=block_size, token=token,
                                  ticket=ticket, state_bytes=state_bytes, stripes=stripes,
                                  layer_groups=layer_groups).wire()
    n = len(tokens)
    step = max(1, n // HELLO_SAMPLE)
    sample = tokens[::step]
    digits = round(sum(len(str(t)) for t in sample) * n / len(sample)) if sample else 0
    return HDR.size + len(empty) + digits + max(0, n - 1)


def block_frames_bytes(tokens: int, per_token: int, block_size: int, frame_tokens: int = 0) -> int:
    """The BLOCK frames carrying ``tokens`` tokens of KV (``kv_wire._send``'s framing)."""
    per_frame = max(block_size, (frame_tokens or FRAME_TOKENS) // block_size * block_size)
    frames = -(-tokens // per_frame)
    return frames * (HDR.size + BLOCK_HDR.size) + tokens * per_token


def state_frames_bytes(state_bytes: int) -> int:
    """The STATE frames carrying a request's fixed-size state (``kv_wire._send``'s framing)."""
    return -(-state_bytes // STATE_FRAME) * HDR.size + state_bytes


class SimTransport:
    """One host's way to the broker and its KV peers in the simulation."""

    def __init__(self, net: SimNet, host: str) -> None:
        self.net, self.host = net, host

    # ----------------------------------------------------------------- the broker
    def mqtt_client(self, broker: BrokerInfo, identifier: str, keepalive: int,
                    will: aiomqtt.Will | None = None) -> aiomqtt.Client:
        client = self.net.broker.client(self.host, identifier, keepalive, will)
        self.net.clients.setdefault(self.host, []).append(client)
        return client  # type: ignore[return-value]

    async def discard_session(self, broker: BrokerInfo, identifier: str) -> None:
        self.net.broker.discard(identifier)

    # ----------------------------------------------------------------- ports
    async def serve_kv(self, host: str, port: int, offer: OfferFn, done: DoneFn, fail: FailFn,
                       opts: KvServe = SERVE_DEFAULTS) -> object:
        lst = _Listener(self.host, offer, done, fail, opts.zeros, opts.state_bytes)
        self.net.listeners[(host, port)] = lst
        return lst

    async def serve_liveness(self, host: str, port: int, netns: str | None) -> object:
        lst = _Listener(self.host)
        self.net.listeners[(host, port)] = lst
        return lst

    async def probe(self, host: str, port: int, timeout_s: float) -> str:
        links = self.net.links
        path = links.path(self.host, links.host_of_ip[host])
        if path.down():
            await asyncio.sleep(timeout_s)
            return "no answer"
        await asyncio.sleep(links.latency(path.links) + links.latency(path.back))
        lst = self.net.listeners.get((host, port))
        return "alive" if lst is not None and lst.open else "refused"

    # ----------------------------------------------------------------- a transfer
    async def send_kv(self, host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor,
                      first_token: int, block_size: int, opts: KvSend = SEND_DEFAULTS) -> TransferStats:
        if opts.corrupt_block is not None:  # refused before a run (sim/scope.py): never silently dropped
            raise KVTransferError("a corrupt block is the emulation's test fault")
        cancel, timeout_s = opts.cancel, opts.timeout_s
        links = self.net.links
        dst = links.host_of_ip[host]
        path = links.path(self.host, dst)
        kept = self.net.conns.setdefault((self.host, host, port), [])
        conn = next((c for c in kept if not c.busy), None)
        if conn is None:
            conn = Conn(path, kv=True)
            kept.append(conn)
        conn.busy = True
        st = TransferStats(request_id, f"{host}:{port}", clock.now())
        layers, _, heads, n, head_dim = kv.shape
        per_token = layers * 2 * heads * head_dim * kv.element_size()
        abort = asyncio.Event()  # the receiver went away
        stops = [ev for ev in (cancel, abort) if ev is not None]
        sides: list[Conn] = []  # the transfer's further connections (kv_connections)
        lst: _Listener | None = None
        receiving = False
        clean = False
        try:
            fresh = not conn.established
            if fresh:
                await self._connect(conn, host, port, timeout_s)
            lst = self.net.listeners.get((host, port))
            if lst is None or not lst.open or lst.offer is None:
                raise KVTransferError(f"connect to {host}:{port}: [Errno 111] Connect call failed")
            lst.aborts.add(abort)
            await asyncio.sleep(links.prepare(conn))
            ticket = opts.ticket
            groups = max(1, min(opts.layer_groups, layers)) if opts.computed is not None else 1  # (kv_wire._send)
            hello = hello_bytes(request_id, tokens, (layers, heads, head_dim), kv.dtype, block_size, opts.token,
                                ticket, opts.state_bytes, opts.connections, groups)
            if fresh:  # a connection's first frame is its AUTH (kv_wire.send_kv)
                hello += HDR.size + len(Auth(token=opts.token).model_dump_json())
            await self._push(conn, hello, stops, timeout_s, st)
            if any(ev.is_set() for ev in stops):
                return self._cut(st, [conn], lst, request_id, receiving)
            await asyncio.sleep(links.latency(path.links))
            receiving = True  # the receiver has the request id: a broken transfer fails it there
            start = clock.now()
            if opts.state_bytes != lst.state_bytes:  # the receiver refuses the HELLO (kv_wire.receive_kv)
                why = f"request state of {opts.state_bytes} bytes announced, this worker takes {lst.state_bytes}"
                self.net.spawn(lst.fail, request_id, f"KV transfer for {request_id} failed: {why}")  # type: ignore[arg-type]
                await asyncio.sleep(links.latency(path.back))
                raise KVTransferError(f"receiver refused: KV transfer for {request_id} failed: {why}")
            try:
                have = await lst.offer(request_id, tokens, ticket)
            except Exception as e:  # noqa: BLE001 - the receiver refuses: both sides fail the request,
                if not isinstance(e, KVRefused):  # or only the sender, when it lacked the ticket (kv_wire)
                    self.net.spawn(lst.fail, request_id, f"KV transfer for {request_id} failed: {e}")  # type: ignore[arg-type]
                await asyncio.sleep(links.latency(path.back))
                raise KVTransferError(f"receiver refused: {e}") from None
            await asyncio.sleep(links.latency(path.back))
            st.receiver_had = have
            state = opts.state_bytes
            st.planned_payload = (n - have) * per_token + state
            frames = kv_stripes.frames_of(have, n, per_token, block_size, opts.frame_tokens)
            end = HDR.size + len(End(first_token=first_token, n=n).model_dump_json())
            tail = state_frames_bytes(state) + end
            k = min(opts.connections, len(frames) * groups)
            order, size = None, kv_stripes.layer_sizes(per_token // layers, layers, groups, n, block_size,
                                                       opts.frame_tokens)
            if groups > 1 and opts.computed is not None:  # per layer: frames of one layer group each
                order = LayerOrder(opts.computed, have, n, kv_stripes.per_frame(block_size, opts.frame_tokens),
                                   groups)
            if k <= 1 and order is not None:
                sent = await kv_stripes.stream_layers(links, conn, order, 0, 1, size, tail, stops, timeout_s)
            elif k <= 1:
                sent = await kv_stripes.stream(links, conn, opts.computed, frames, tail, stops, timeout_s)
            else:  # frame j on connection j % k (kv_wire._send)

                def free() -> Conn:
                    c = next((c for c in kept if not c.busy), None)
                    if c is None:
                        c = Conn(path, kv=True)
                        kept.append(c)
                    c.busy = True
                    return c

                sent = await kv_stripes.send_striped(
                    links, conn, free, k, opts.token, opts.computed, frames, tail, end, stops, timeout_s, sides,
                    lambda c: asyncio.ensure_future(self._connect(c, host, port, timeout_s)), order, size)
            st.bytes_sent += round(sent)
            st.tokens_sent = min(n - have, int(sent // per_token))
            st.payload_bytes = st.tokens_sent * per_token
            if any(ev.is_set() for ev in stops) or not lst.open:
                return self._cut(st, [conn, *sides], lst, request_id, receiving)
            st.tokens_sent, st.payload_bytes = n - have, (n - have) * per_token + state
            await asyncio.sleep(links.latency(path.links))
            if not lst.open:
                raise KVTransferError(f"transfer to {host}:{port} broke: Connection reset by peer")
            zeros = lst.zeros
            got = zeros(n - have) if zeros is not None else kv[:, :, :, have:]
            inc = Incoming(request_id, tokens, have, got, first_token, st.bytes_sent, start, clock.now())
            self.net.spawn(_arrived, lst, inc)
            await asyncio.sleep(links.latency(path.back))
            st.bytes_acked = st.bytes_sent
            clean = True
        except TimeoutError as e:
            if lst is not None and receiving:
                self.net.spawn(lst.fail, request_id, f"KV transfer for {request_id} failed: nothing from the peer "  # type: ignore[arg-type]
                       f"for {timeout_s:g} s")
            raise KVTransferError(str(e)) from None
        except asyncio.CancelledError:  # the sender's process ended: the receiver sees a reset
            if lst is not None and receiving and lst.fail is not None:
                self.net.spawn(lst.fail, request_id, f"KV transfer for {request_id} failed: connection lost")
            raise
        finally:
            st.end = clock.now()
            for c in (conn, *sides):
                c.busy = False
                if not clean:
                    c.established = False  # a cut-off or broken connection is closed
            if lst is not None:
                lst.aborts.discard(abort)
        return st

    async def _connect(self, conn: Conn, host: str, port: int, timeout_s: float | None) -> None:
        links = self.net.links
        path = conn.path
        if path.down():
            try:
                async with asyncio.timeout(timeout_s):
                    await links.wait_up([*path.links, *path.back])
            except TimeoutError:
                raise KVTransferError(f"connect to {host}:{port}: timed out") from None

    async def _push(self, conn: Conn, nbytes: int, stops: list[asyncio.Event], timeout_s: float | None,
                    st: TransferStats) -> float:
        sent = await self.net.links.send(conn, nbytes, stops, timeout_s)
        st.bytes_sent += round(sent)
        return sent

    def _cut(self, st: TransferStats, conns: list[Conn], lst: _Listener, rid: str, receiving: bool) -> TransferStats:
        """Cut off (the connection is reset): what the connection's window held was in flight,
        unacknowledged (the kernel's count; ``tcp_info``), the rest had been acknowledged; the
        receiver sees the reset after the path's delay. The window, not one bandwidth-delay
        product: a connection that filled it keeps its buffer's worth queued too (a cold trace's
        221 cut-offs on ``paper.yaml``: 352 KB in flight on average in the emulation, against a
        BDP of 163 KB and a window bound of 336 KB; ``docs/simulation.md``)."""
        links = self.net.links
        if not lst.open:  # the receiver died: a broken transfer, not a cut-off
            raise KVTransferError(f"transfer to {st.peer} broke: Connection reset by peer")
        st.cancelled = True
        window = sum(round(c.cwnd * c.path.mss) for c in conns if c.path.links)
        st.bytes_in_flight = min(st.bytes_sent, window)
        st.bytes_acked = st.bytes_sent - st.bytes_in_flight
        if receiving and lst.fail is not None:
            fail = lst.fail
            links.loop.call_later(links.latency(conns[0].path.links), self.net.spawn, fail, rid,
                                  f"KV transfer for {rid} failed: Connection reset by peer")
        return st


async def _arrived(lst: _Listener, inc: Incoming) -> None:
    """The receiver's ``done`` for a transfer that ended; an error in it fails the request
    there (``kv_wire.receive_kv`` catches it the same way)."""
    assert lst.done is not None and lst.fail is not None
    try:
        await lst.done(inc)
    except Exception as e:  # noqa: BLE001 - the receiver's error fails its request, never the sender
        with contextlib.suppress(Exception):
            await lst.fail(inc.request_id, f"KV transfer for {inc.request_id} failed: {e}")
