"""KV-cache wire format and point-to-point TCP transfer between workers.

Every frame starts with a 12-byte header ``!4sBBHI``: magic ``PDKV``, version (1), frame
type, reserved, payload length. A transfer is one TCP connection from sender to receiver:

1. ``HELLO`` (sender -> receiver, JSON): request id, prompt tokens, dtype, layers,
   kv_heads, head_dim, block size.
2. ``OFFER`` (receiver -> sender, JSON): ``{"have": k}`` — the receiver's cached prefix
   length in tokens (or ``{"error": ...}``). Only tokens ``[k, n)`` are sent.
3. ``BLOCK`` (sender -> receiver), one per frame of whole KV blocks (``FRAME_TOKENS``, one
   block by default; the last may be shorter), all layers: a fixed header
   ``!IIIHHHHBxxxI`` (frame index, first token, tokens, layer start, layer end, kv_heads,
   head_dim, dtype code, crc32 of the payload) and the raw tensor
   ``(layers, 2, kv_heads, tokens, head_dim)`` in C order, native little-endian.
4. ``END`` (sender -> receiver, JSON): the first generated token and the total count.
5. ``ACK`` (receiver -> sender, JSON): ``{"ok": true}`` or ``{"error": ...}``.

``EXTEND`` (JSON token IDs to recompute) is used only by ``testbed bench handoff``, which
compares shipping KV blocks with shipping token IDs over the same framing; blocking-socket
versions of the framing (``send_frame`` / ``recv_frame``) serve it. Every frame type and
framing helper lives here.

The receiver trusts nothing its peer sends: every frame's length is capped before it is
read (control frames ``MAX_CONTROL_FRAME``, HELLO ``MAX_HELLO``, a BLOCK at most the KV
still missing), HELLO is a validated ``Hello`` (request id alphabet, at most
``MAX_PROMPT_TOKENS`` token ids, a dtype from a whitelist) whose layout must equal the
receiver's own model (``ModelShape``), and every block is verified (checksum, shape,
dtype, length, contiguity) before it is used. Anything else ends that transfer with a
reason on both sides (``fail``); the server serves on. ``cancel`` cuts a transfer off at
once, even mid-block: the connection is reset (SO_LINGER 0), so bytes still queued in the
sender's socket buffer are discarded instead of crossing the link; ``bytes_acked`` (from
the kernel's ``tcp_info``) says how much the receiver really got. PDD cuts off useless WAN
transfers this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.control import RequestId

MAGIC = b"PDKV"
VERSION = 1
HDR = struct.Struct("!4sBBHI")
BLOCK_HDR = struct.Struct("!IIIHHHHBxxxI")
# One block per frame. 256-token frames cut the sender's Python work 16x (PDD's prefill
# overran 3-31 ms beside its sends) but changed cross-datacenter TTFT with the dilation in
# tests/test_fidelity.py (2.3 s at D 4 vs 1.7 s at D 8, twice): not understood yet, not used.
FRAME_TOKENS = 16
HELLO, OFFER, BLOCK, END, ACK, EXTEND = 1, 2, 3, 4, 5, 6
DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {str(d): d for d in DTYPE_CODES}  # "torch.float32" -> torch.float32: the only dtypes read
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_CONTROL_FRAME = 64 * 1024  # OFFER, END, ACK: a few small JSON fields
MAX_HELLO = 1024 + 12 * MAX_PROMPT_TOKENS  # JSON token ids of at most 10 digits and ", "


class KVTransferError(Exception):
    pass


@dataclass(frozen=True)
class ModelShape:
    """The KV layout of one model as run: what a receiver accepts and a sender sends."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


F = TypeVar("F", bound=_Frame)


class Hello(_Frame):
    rid: RequestId
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    dtype: Literal["torch.float32", "torch.float64", "torch.bfloat16", "torch.float16"]
    layers: int = Field(ge=1, le=4096)
    kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    block_size: int = Field(ge=1, le=1 << 20)
    token: str = Field(default="", max_length=256)  # the run's KV token (only the run's workers know it)

    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.kv_heads, self.head_dim, DTYPE_NAMES[self.dtype])


class Offer(_Frame):
    have: int | None = Field(default=None, ge=0)
    error: str | None = None


class End(_Frame):
    first_token: int = Field(ge=0, le=MAX_TOKEN_ID)
    n: int = Field(ge=1, le=MAX_PROMPT_TOKENS)


class Ack(_Frame):
    ok: bool = False
    error: str | None = None


def _parse(model: type[F], payload: bytes, what: str) -> F:
    try:
        return model.model_validate_json(payload)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "frame"
        raise KVTransferError(f"bad {what}: {where}: {err['msg']}") from None


@dataclass
class TransferStats:
    request_id: str
    peer: str
    start: float
    end: float = 0.0
    bytes_sent: int = 0
    payload_bytes: int = 0
    tokens_sent: int = 0
    receiver_had: int = 0
    cancelled: bool = False
    bytes_acked: int = 0  # what the receiver's TCP acknowledged (all of bytes_sent unless cut off)
    planned_payload: int = 0  # payload bytes the receiver lacked (what a full transfer sends)
    error: str | None = None


async def _write(w: asyncio.StreamWriter, ftype: int, payload: bytes) -> int:
    w.write(HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)))
    w.write(payload)
    await w.drain()
    return HDR.size + len(payload)


async def _read(r: asyncio.StreamReader, max_len: int = MAX_CONTROL_FRAME) -> tuple[int, bytes]:
    """One frame; its announced length is checked against ``max_len`` before anything is read."""
    hdr = await r.readexactly(HDR.size)
    magic, ver, ftype, _, n = HDR.unpack(hdr)
    if magic != MAGIC or ver != VERSION:
        raise KVTransferError(f"bad frame header {hdr[:8]!r}")
    if n > max_len:
        raise KVTransferError(f"frame type {ftype} announces {n} bytes (at most {max_len} expected)")
    return ftype, await r.readexactly(n)


def send_frame(sock: socket.socket, ftype: int, payload: bytes) -> int:
    """Blocking-socket ``_write``: one frame; returns the bytes written."""
    sock.sendall(HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)) + payload)
    return HDR.size + len(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise KVTransferError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_len: int = MAX_HELLO) -> tuple[int, bytes]:
    """Blocking-socket ``_read``: (frame type, payload). Raises KVTransferError."""
    magic, ver, ftype, _, n = HDR.unpack(_recv_exact(sock, HDR.size))
    if magic != MAGIC or ver != VERSION:
        raise KVTransferError("bad frame header")
    if n > max_len:
        raise KVTransferError(f"frame type {ftype} announces {n} bytes (at most {max_len} expected)")
    return ftype, _recv_exact(sock, n)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def encode_block(idx: int, start: int, part: torch.Tensor, corrupt: bool = False) -> tuple[bytes, int]:
    """A BLOCK frame's payload for ``part`` = KV of tokens ``[start, start + n)``, and its
    tensor byte count. ``corrupt`` flips a byte after the checksum (fault injection)."""
    data = _tensor_bytes(part)
    crc = zlib.crc32(data)
    if corrupt:
        data = bytes([data[0] ^ 0xFF]) + data[1:]
    layers, _, heads, n, head_dim = part.shape
    hdr = BLOCK_HDR.pack(idx, start, n, 0, layers, heads, head_dim, DTYPE_CODES[part.dtype], crc)
    return hdr + data, len(data)


@dataclass
class Block:
    first: int  # first token
    kv: torch.Tensor  # (layers, 2, kv_heads, tokens, head_dim)


def decode_block(payload: bytes, layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> Block:
    """Verify (length, checksum, shape, dtype) and decode a BLOCK payload. Raises KVTransferError."""
    if len(payload) < BLOCK_HDR.size:
        raise KVTransferError(f"block frame of {len(payload)} bytes is shorter than its header")
    _, first, count, l0, l1, b_heads, hd, code, crc = BLOCK_HDR.unpack_from(payload)
    data = payload[BLOCK_HDR.size :]
    if zlib.crc32(data) != crc:
        raise KVTransferError(f"block at token {first}: checksum mismatch")
    if (l0, l1, b_heads, hd) != (0, layers, heads, head_dim) or CODE_DTYPES.get(code) != dtype:
        raise KVTransferError(f"block at token {first}: unexpected shape/dtype")
    per_token = layers * 2 * heads * head_dim * torch.finfo(dtype).bits // 8
    if count < 1 or len(data) != count * per_token:
        raise KVTransferError(f"block at token {first}: {len(data)} bytes for {count} tokens")
    return Block(first, torch.frombuffer(bytearray(data), dtype=dtype).view(layers, 2, heads, count, hd))


async def send_kv(
    host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor, first_token: int,
    block_size: int, cancel: asyncio.Event | None = None, corrupt_block: int | None = None,
    on_progress: Callable[[TransferStats], None] | None = None, frame_tokens: int = 0, token: str = "",
) -> TransferStats:
    """Send the part of ``kv`` (for ``tokens``) the receiver lacks, in frames of whole blocks
    (``frame_tokens``, default ``FRAME_TOKENS``). Raises KVTransferError."""
    # The sender's event loop runs beside a compute thread that needs the GIL after every
    # torch op: Python work per frame is time taken from a paced step (see FRAME_TOKENS).
    per_frame = max(block_size, (frame_tokens or FRAME_TOKENS) // block_size * block_size)
    st = TransferStats(request_id, f"{host}:{port}", time.time())
    layers, _, heads, n, head_dim = kv.shape
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        raise KVTransferError(f"connect to {host}:{port}: {e}") from e
    sock = writer.get_extra_info("socket")

    async def cut_off() -> None:
        assert cancel is not None
        await cancel.wait()
        st.cancelled = True
        st.bytes_acked = _bytes_acked(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST: queued bytes are dropped, not sent

    watcher = asyncio.create_task(cut_off()) if cancel is not None else None
    try:
        hello = Hello(rid=request_id, tokens=tokens, dtype=str(kv.dtype), layers=layers,  # type: ignore[arg-type]
                      kv_heads=heads, head_dim=head_dim, block_size=block_size, token=token)
        st.bytes_sent += await _write(writer, HELLO, hello.model_dump_json().encode())
        ftype, payload = await _read(reader)
        if ftype == ACK:  # refused before any offer (a bad HELLO): the receiver says why
            raise KVTransferError(f"receiver refused: {_parse(Ack, payload, 'ACK').error}")
        offer = _parse(Offer, payload, "OFFER")
        if ftype != OFFER or offer.error is not None or offer.have is None:
            raise KVTransferError(f"receiver refused: {offer.error or f'frame type {ftype}'}")
        if offer.have > n or offer.have % block_size:
            raise KVTransferError(f"receiver offered {offer.have} cached tokens of {n} (block {block_size})")
        have = offer.have
        st.receiver_had = have
        st.planned_payload = (n - have) * kv[:, :, :, :1].numel() * kv.element_size()
        for idx, start in enumerate(range(have, n, per_frame)):
            if st.cancelled:
                break
            part = kv[:, :, :, start : start + per_frame]
            # Fault injection names a block; its frame is the one corrupted.
            hit = corrupt_block is not None and start <= corrupt_block * block_size < start + per_frame
            frame, nbytes = encode_block(idx, start, part, corrupt=hit)
            st.bytes_sent += await _write(writer, BLOCK, frame)
            st.payload_bytes += nbytes
            st.tokens_sent += part.shape[3]
            if on_progress:
                on_progress(st)
        if not st.cancelled:
            st.bytes_sent += await _write(writer, END, End(first_token=first_token, n=n).model_dump_json().encode())
            ftype, payload = await _read(reader)
            ack = _parse(Ack, payload, "ACK")
            if ftype != ACK or not ack.ok:
                raise KVTransferError(f"receiver rejected the transfer: {ack.error or f'frame type {ftype}'}")
            st.bytes_acked = st.bytes_sent
    except (OSError, asyncio.IncompleteReadError) as e:
        if not st.cancelled:
            raise KVTransferError(f"transfer to {host}:{port} broke: {e}") from e
    finally:
        st.end = time.time()
        if watcher is not None:
            watcher.cancel()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return st


def _bytes_acked(sock: socket.socket) -> int:
    """tcp_info.tcpi_bytes_acked (Linux >= 4.1): bytes the peer acknowledged."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return 0
    return int(struct.unpack_from("Q", info, 120)[0])


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


OfferFn = Callable[[str, list[int]], Awaitable[int]]
DoneFn = Callable[[Incoming], Awaitable[None]]
FailFn = Callable[[str, str], Awaitable[None]]


async def serve_kv(host: str, port: int, offer: OfferFn, done: DoneFn, fail: FailFn,
                   expect: ModelShape | None = None, token: str = "") -> asyncio.Server:
    """Accept transfers (``receive_kv`` for each connection)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await receive_kv(reader, writer, offer, done, fail, expect, token)

    return await asyncio.start_server(handle, host, port)


async def receive_kv(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, offer: OfferFn, done: DoneFn,
                     fail: FailFn, expect: ModelShape | None = None, token: str = "") -> None:
    """One transfer, receiver side. ``offer(rid, tokens)`` returns the cached prefix length to
    claim; ``expect`` (the receiver's own model) is the only KV layout accepted, and with a
    ``token`` only a HELLO carrying it (a sender of this run) is served. Never raises:
    whatever the peer sends, the transfer ends with ``done`` or with ``fail`` and a reason
    (``fail`` only once the request id is known), and the connection is closed."""
    rid: str | None = None
    start = time.time()
    received = 0
    try:
        ftype, payload = await _read(reader, MAX_HELLO)
        received += HDR.size + len(payload)
        if ftype != HELLO:
            raise KVTransferError(f"expected HELLO, got frame type {ftype}")
        hello = _parse(Hello, payload, "HELLO")
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            raise KVTransferError("HELLO without this run's KV token")  # a stranger: no request is failed
        rid, tokens, shape = hello.rid, hello.tokens, hello.shape()
        if expect is not None and shape != expect:
            raise KVTransferError(f"KV layout {shape} is not this worker's {expect}")
        try:
            have = await offer(rid, tokens)
        except Exception as e:  # noqa: BLE001 - reported to the sender
            await _write(writer, OFFER, Offer(error=str(e)).model_dump_json().encode())
            raise KVTransferError(str(e)) from e
        await _write(writer, OFFER, Offer(have=have).model_dump_json().encode())
        n = len(tokens)
        kv = torch.empty((shape.layers, 2, shape.kv_heads, n - have, shape.head_dim), dtype=shape.dtype)
        pos = have
        while True:
            # A block holds at most the KV still missing.
            limit = BLOCK_HDR.size + (n - pos) * shape.kv_bytes_per_token if pos < n else MAX_CONTROL_FRAME
            ftype, payload = await _read(reader, max(limit, MAX_CONTROL_FRAME))
            received += HDR.size + len(payload)
            if ftype == END:
                end = _parse(End, payload, "END")
                if pos != n or end.n != n:
                    raise KVTransferError(f"transfer ended at token {pos} of {n}")
                await _write(writer, ACK, b'{"ok": true}')
                await done(Incoming(rid, tokens, have, kv, end.first_token, received, start, time.time()))
                return
            if ftype != BLOCK:
                raise KVTransferError(f"unexpected frame type {ftype}")
            blk = decode_block(payload, shape.layers, shape.kv_heads, shape.head_dim, shape.dtype)
            count = blk.kv.shape[3]
            if blk.first != pos or pos + count > n:
                raise KVTransferError(f"block at token {blk.first}: expected token {pos}")
            kv[:, :, :, pos - have : pos - have + count] = blk.kv
            pos += count
    except Exception as e:  # noqa: BLE001 - a bad peer fails its transfer, never the server
        msg = f"KV transfer for {rid or '?'} failed: {e or type(e).__name__}"
        with contextlib.suppress(Exception):
            await _write(writer, ACK, Ack(error=msg).model_dump_json().encode())
        if rid is not None:
            await fail(rid, msg)
    finally:
        writer.close()
