"""The receiving side of the KV wire (``workers/kv_wire.py`` says the protocol, the bounds
and why a receiver trusts nothing its peer sends): ``serve_kv`` accepts connections and
``receive_kv`` takes one transfer, ending it with ``done`` or with ``fail`` and a reason."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from protocol import clock
from protocol.kv_format import (
    ACK,
    BLOCK,
    END,
    HDR,
    HELLO,
    JOIN,
    MAX_HELLO,
    OFFER,
    STATE,
    Ack,
    End,
    Hello,
    KVRefused,
    KVTransferError,
    ModelShape,
    Offer,
    parse_frame,
)
from workers.kv_conn import IDLE_FACTOR, MAX_CONNECTIONS, Admission, PeerSilent, listen, read_frame, write_frame
from workers.kv_stripes import Assembly, serve_stripe


@dataclass
class Incoming:
    """What a receiver got: the KV of tokens ``[have, n)`` plus the first token."""

    request_id: str
    tokens: list[int]
    have: int
    kv: torch.Tensor
    first_token: int
    bytes_received: int
    start: float
    end: float


OfferFn = Callable[[str, list[int], str], Awaitable[int]]
DoneFn = Callable[[Incoming], Awaitable[None]]
FailFn = Callable[[str, str], Awaitable[None]]


async def serve_kv(host: str, port: int, offer: OfferFn, done: DoneFn, fail: FailFn,
                   expect: ModelShape | None = None, token: str = "",
                   zeros: Callable[[int], torch.Tensor] | None = None, netns: str | None = None,
                   timeout_s: float | None = None, max_connections: int = MAX_CONNECTIONS,
                   state_bytes: int = 0) -> asyncio.Server:
    """Accept transfers (``receive_kv`` for each connection, at most ``max_connections``
    authenticated at once, and ``MAX_UNAUTHENTICATED`` still to authenticate: the oldest of
    those is closed for a new one); ``netns``: listen inside that namespace (a process
    standing for several hosts); ``state_bytes``: the fixed-size state every transfer carries
    after its KV (the only size taken). A transfer may use several connections
    (``workers/kv_stripes.py``): the ones in progress are found by their key here."""
    gate = Admission(max_connections, token, timeout_s)
    joins: dict[str, Assembly] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await gate.admit(reader, writer):
            return
        try:
            while await receive_kv(reader, writer, offer, done, fail, expect, token, keep_open=True, zeros=zeros,
                                   timeout_s=timeout_s, state_bytes=state_bytes, joins=joins):
                pass  # the sender may send its next transfer on this connection
        finally:
            gate.release()
            writer.close()

    return await listen(handle, host, port, netns)


async def receive_kv(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, offer: OfferFn, done: DoneFn,
                     fail: FailFn, expect: ModelShape | None = None, token: str = "", keep_open: bool = False,
                     zeros: Callable[[int], torch.Tensor] | None = None, timeout_s: float | None = None,
                     state_bytes: int = 0, joins: dict[str, Assembly] | None = None) -> bool:
    """One transfer, receiver side. ``offer(rid, tokens, ticket)`` returns the cached prefix
    length to claim (or refuses the sender, ``KVRefused``, and the request is not failed);
    ``expect`` (the receiver's own model) is the only KV layout accepted, and with a
    ``token`` only a HELLO carrying it (a sender of this run) is served. Never raises:
    whatever the peer sends, the transfer ends with ``done`` or with ``fail`` and a reason
    (``fail`` only once the request id is known). True when it ended cleanly and, with
    ``keep_open``, the connection stays open for the sender's next transfer; otherwise the
    connection is closed. A sender that closes an idle connection is no failure. A modeled
    receiver passes ``zeros`` (KV of n tokens as a zero view): every block is checked as
    always, but its content is not copied, and the transfer hands over ``zeros(n)``. With
    ``timeout_s`` every frame of a transfer must come within it, and a kept connection idle
    for ``IDLE_FACTOR`` times as long is closed. ``state_bytes``: the request state every
    transfer must carry after its KV (a HELLO announcing another size is refused).
    ``joins``: the transfers in progress that further connections may join (a HELLO may then
    ask for several; without it, one connection each)."""
    rid: str | None = None
    received = 0
    ok = False
    key: str | None = None
    asm: Assembly | None = None
    try:
        try:
            ftype, payload = await read_frame(reader, MAX_HELLO, None if timeout_s is None else IDLE_FACTOR * timeout_s)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
            return False  # the sender closed the connection between transfers
        except PeerSilent:
            return False  # idle too long: closed without a word (a sender finds it closed and reconnects)
        if ftype == JOIN and joins is not None:  # a further connection of a transfer in progress
            ok, _ = await serve_stripe(reader, writer, payload, joins, timeout_s)
            return ok and keep_open
        start = clock.now()  # the transfer's start (a kept connection may idle before it)
        received += HDR.size + len(payload)
        if ftype != HELLO:
            raise KVTransferError(f"expected HELLO, got frame type {ftype}")
        hello = parse_frame(Hello, payload, "HELLO")
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            raise KVTransferError("HELLO without this run's KV token")  # a stranger: no request is failed
        rid, tokens, shape = hello.rid, hello.tokens, hello.shape()
        if expect is not None and shape != expect:
            raise KVTransferError(f"KV layout {shape} is not this worker's {expect}")
        if hello.state_bytes != state_bytes:
            raise KVTransferError(f"request state of {hello.state_bytes} bytes announced, this worker takes "
                                  f"{state_bytes}")
        try:
            have = await offer(rid, tokens, hello.ticket)
        except Exception as e:  # noqa: BLE001 - reported to the sender
            rid = None if isinstance(e, KVRefused) else rid  # not its sender: the request waits on for its own
            await write_frame(writer, OFFER, Offer(error=str(e)).model_dump_json(exclude_none=True).encode())
            raise KVTransferError(str(e)) from e
        n = len(tokens)
        kv = (zeros(n - have) if zeros is not None
              else torch.empty((shape.layers, 2, shape.kv_heads, n - have, shape.head_dim), dtype=shape.dtype))
        if hello.layer_groups > shape.layers:
            raise KVTransferError(f"{hello.layer_groups} layer groups of a model of {shape.layers} layers")
        stripes = hello.stripes if joins is not None else 1
        asm = Assembly(rid, shape, have, n, hello.block_size, stripes, kv, modeled=zeros is not None,
                       state_bytes=state_bytes, groups=hello.layer_groups)
        if stripes > 1:
            key = secrets.token_hex(16)
            joins[key] = asm  # type: ignore[index]
        await write_frame(writer, OFFER, Offer(have=have, key=key).model_dump_json(exclude_none=True).encode(),
                          timeout_s)
        while True:
            ftype, payload = await read_frame(reader, asm.limit(), timeout_s)
            received += HDR.size + len(payload)
            if ftype == END:
                end = parse_frame(End, payload, "END")
                if end.n != n:
                    raise KVTransferError(f"transfer ended for {end.n} tokens, its HELLO said {n}")
                await asm.until_complete(timeout_s)  # blocks still on the other connections
                await write_frame(writer, ACK, b'{"ok": true}', timeout_s)
                ok = True
                await done(Incoming(rid, tokens, have, kv, end.first_token, received + asm.received, start,
                                    clock.now()))
                return keep_open
            if ftype == STATE:
                asm.add_state(len(payload))
            elif ftype == BLOCK:
                asm.put(payload)
            else:
                raise KVTransferError(f"unexpected frame type {ftype}")
            # Frames already buffered are read without waiting: yield after each, or a
            # transfer holds the loop (and the paced steps' timers) for its whole length.
            await asyncio.sleep(0)
    except Exception as e:  # noqa: BLE001 - a bad peer fails its transfer, never the server
        why = asm.error if asm is not None and asm.error is not None else (str(e) or type(e).__name__)
        msg = f"KV transfer for {rid or '?'} failed: {why}"
        if asm is not None:
            asm.fail(msg)  # its other connections stop too
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):  # a courtesy: a peer that takes nothing is not waited for
                await write_frame(writer, ACK, Ack(error=msg).model_dump_json().encode())
        if rid is not None:
            await fail(rid, msg)
        return False
    finally:
        if key is not None and joins is not None:
            joins.pop(key, None)
        if not (ok and keep_open):
            writer.close()
