"""A KV transfer as it arrives, over one connection or several (``kv_connections``).

``Assembly`` is the receiver's side of one transfer: the KV of tokens ``[have, n)`` filled
block by block, each block checked (shape, dtype, checksum, bounds, whole blocks) and taken
exactly once, in any order across the transfer's connections; the request's fixed-size state
counted; the transfer complete when every block and every state byte has come. The first
connection (HELLO, OFFER, END: ``workers/kv_receive.py``) owns it; a further one joins it
by the key its OFFER gave (``serve_stripe``), carries blocks and ends with its own END/ACK.
A joining connection with an unknown key is a stranger (refused, nothing failed); one with
the key that breaks a rule (a stripe number out of range or taken twice, a bad or repeated
block) fails the whole transfer, since only its sender was given the key.

``open_side`` is the sender's: a further connection, kept or fresh, joined to a transfer and
confirmed by the receiver before any block is sent on it (a kept connection the receiver has
closed meanwhile is replaced by a fresh one, as the first connection's is).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.kv_format import (
    ACK,
    BLOCK,
    BLOCK_HDR,
    END,
    HDR,
    JOIN,
    MAX_CONTROL_FRAME,
    STATE_FRAME,
    Ack,
    End,
    Join,
    KVTransferError,
    ModelShape,
    check_block_span,
    decode_block,
    layer_bounds,
    parse_frame,
)
from workers.kv_conn import Conn, Connections, open_authenticated, read_frame, write_frame


@dataclass(eq=False)
class Assembly:
    """One transfer's KV as it arrives (the receiver's)."""

    rid: str
    shape: ModelShape
    have: int
    n: int
    block_size: int
    stripes: int  # connections the sender may use (1: the first alone)
    kv: torch.Tensor  # (layers, 2, kv_heads, n - have, head_dim); a zero view when ``modeled``
    modeled: bool = False  # blocks are checked, not copied (a modeled receiver keeps no KV)
    state_bytes: int = 0
    groups: int = 1  # layer groups a block carries one of (per-layer transfers; 1: all layers)
    missing: int = 0  # KV bytes still to come
    state: int = 0  # state bytes received
    joined: set[int] = field(default_factory=set)  # further connections' stripe numbers
    error: str | None = None  # a joined connection broke a rule: the transfer fails
    received: int = 0  # bytes over the further connections (the first counts its own)
    _got: bytearray = field(default_factory=bytearray)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._blocks = -(-(self.n - self.have) // self.block_size)
        self._got = bytearray(self.groups * self._blocks)  # per layer group, per block: 1 once taken
        self._bounds = layer_bounds(self.shape.layers, self.groups) if self.groups > 1 else ()
        self.missing = (self.n - self.have) * self.shape.kv_bytes_per_token

    @property
    def complete(self) -> bool:
        return self.missing == 0 and self.state == self.state_bytes

    def limit(self) -> int:
        """The largest frame a connection of this transfer may announce next: a block of at
        most the KV still missing, a state frame of at most the state still missing, or a
        control frame."""
        kv = BLOCK_HDR.size + self.missing
        return max(MAX_CONTROL_FRAME, kv, min(STATE_FRAME, self.state_bytes - self.state))

    def put(self, payload: bytes) -> None:
        """Take one BLOCK frame. Raises KVTransferError."""
        s = self.shape
        if self.modeled:
            first, count, l0, l1 = check_block_span(payload, s.layers, s.kv_heads, s.head_dim, s.dtype, self._bounds)
            blk = None
        else:
            blk = decode_block(payload, s.layers, s.kv_heads, s.head_dim, s.dtype, self._bounds)
            first, count, l0, l1 = blk.first, blk.kv.shape[3], blk.layer0, blk.layer0 + blk.kv.shape[0]
        end = first + count
        if first < self.have or end > self.n or (first - self.have) % self.block_size or (
                count % self.block_size and end != self.n):
            raise KVTransferError(f"block of tokens [{first}, {end}) is not whole blocks of [{self.have}, {self.n})")
        row = (self._bounds.index(l0) if self._bounds else 0) * self._blocks
        b0, b1 = row + (first - self.have) // self.block_size, row + -(-(end - self.have) // self.block_size)
        if any(self._got[b0:b1]):
            raise KVTransferError(f"block at token {first} (layers {l0}-{l1}) came twice")
        self._got[b0:b1] = b"\x01" * (b1 - b0)
        if blk is not None:
            self.kv[l0:l1, :, :, first - self.have : end - self.have] = blk.kv
        self.missing -= len(payload) - BLOCK_HDR.size
        self._changed.set()

    def add_state(self, nbytes: int) -> None:
        if not nbytes or self.state + nbytes > self.state_bytes:
            raise KVTransferError(f"unexpected state frame of {nbytes} bytes, state {self.state} of {self.state_bytes}")
        self.state += nbytes

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        self._changed.set()

    async def until_complete(self, timeout_s: float | None) -> None:
        """Wait for the blocks still on other connections, each within ``timeout_s``. Raises
        KVTransferError (a joined connection failed, or nothing came in time; over one
        connection, at once: nothing else can bring them)."""
        if self.stripes == 1 and not self.complete:
            got = self.n - -(-self.missing // self.shape.kv_bytes_per_token)
            raise KVTransferError(f"transfer ended at token {got} of {self.n}, with {self.state} of "
                                  f"{self.state_bytes} state bytes")
        while not self.complete and self.error is None:
            self._changed.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait()
            except TimeoutError:
                raise KVTransferError(f"ended with {self.missing} bytes of KV missing; they did not come within "
                                      f"{timeout_s:g} s") from None
        if self.error is not None:
            raise KVTransferError(self.error)


async def serve_stripe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes,
                       joins: dict[str, Assembly], timeout_s: float | None) -> tuple[bool, int]:
    """A connection that opened with JOIN: its blocks into the transfer it joins, until its END.
    (True when it ended cleanly and stays open for the sender's next transfer, bytes read).
    Raises KVTransferError with the transfer's request id unknown (a stranger) or failed."""
    join = parse_frame(Join, payload, "JOIN")
    asm = next((a for k, a in joins.items() if hmac.compare_digest(k, join.key)), None)
    if asm is None:
        raise KVTransferError("JOIN for no transfer in progress")
    received = HDR.size + len(payload)
    try:
        if join.stripe >= asm.stripes or join.stripe in asm.joined:
            raise KVTransferError(f"stripe {join.stripe} of {asm.stripes} joined twice or out of range")
        asm.joined.add(join.stripe)
        asm.received += received
        await write_frame(writer, ACK, b'{"ok": true}', timeout_s)  # joined: the sender may send
        while True:
            ftype, payload = await read_frame(reader, asm.limit(), timeout_s)
            received += HDR.size + len(payload)
            asm.received += HDR.size + len(payload)
            if ftype == END:
                end = parse_frame(End, payload, "END")
                if end.n != asm.n:
                    raise KVTransferError(f"stripe {join.stripe} ended for {end.n} tokens, the transfer has {asm.n}")
                await write_frame(writer, ACK, b'{"ok": true}', timeout_s)
                return True, received
            if ftype != BLOCK:
                raise KVTransferError(f"unexpected frame type {ftype} on stripe {join.stripe}")
            asm.put(payload)
            await asyncio.sleep(0)  # as the first connection's reader: never hold the loop
    except Exception as e:  # noqa: BLE001 - the transfer fails (the first connection says so)
        asm.fail(f"stripe {join.stripe}: {e or type(e).__name__}")
        raise KVTransferError(asm.error) from e


async def open_side(host: str, port: int, key: str, stripe: int, token: str, pool: Connections | None,
                    netns: str | None, timeout_s: float | None) -> tuple[Conn, int]:
    """A further connection of a transfer, joined and confirmed: (connection, bytes it took to
    open: AUTH on a fresh one, JOIN). Raises KVTransferError."""
    join = Join(key=key, stripe=stripe).model_dump_json().encode()
    kept = pool.take(host, port) if pool is not None else None
    if kept is not None:
        try:
            return kept, await _join(kept, join, timeout_s)
        except (OSError, asyncio.IncompleteReadError, KVTransferError):
            kept[1].close()  # closed by the receiver while idle: one fresh connection
    conn, auth = await open_authenticated(host, port, netns, timeout_s, token)
    try:
        return conn, auth + await _join(conn, join, timeout_s)
    except (OSError, asyncio.IncompleteReadError, KVTransferError) as e:
        conn[1].close()
        raise KVTransferError(f"stripe {stripe} to {host}:{port} broke: {e}") from e


async def together(coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` side by side: their results, or the first one's error, the others then
    cancelled at once (a transfer's connections stand or fall together)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


async def _join(conn: Conn, join: bytes, timeout_s: float | None) -> int:
    sent = await write_frame(conn[1], JOIN, join, timeout_s)
    ftype, payload = await read_frame(conn[0], timeout_s=timeout_s)
    ack = parse_frame(Ack, payload, "ACK")
    if ftype != ACK or not ack.ok:
        raise KVTransferError(f"receiver refused the stripe: {ack.error or f'frame type {ftype}'}")
    return sent
