"""The KV wire format: frames, their validated payloads, and KV block encoding.

Every frame starts with a 12-byte header ``!4sBBHI``: magic ``PDKV``, version (1), frame
type, reserved, payload length. A transfer (``workers/kv_wire.py``) is one TCP connection
from sender to receiver:

1. ``HELLO`` (sender -> receiver, JSON ``Hello``): request id, prompt tokens, dtype,
   layers, kv_heads, head_dim, block size, the run's KV token.
2. ``OFFER`` (receiver -> sender, JSON ``Offer``): ``{"have": k}`` — the receiver's cached
   prefix length in tokens (or ``{"error": ...}``). Only tokens ``[k, n)`` are sent.
3. ``BLOCK`` (sender -> receiver), one per frame of whole KV blocks (``FRAME_TOKENS``, one
   block by default; the last may be shorter), all layers (or, when the HELLO announced
   ``layer_groups``, one group of them: ``layer_bounds``; per-layer transfers): a fixed header
   ``!IIIHHHHBxxxI`` (frame index, first token, tokens, layer start, layer end, kv_heads,
   head_dim, dtype code, crc32 of the payload) and the raw tensor
   ``(layers, 2, kv_heads, tokens, head_dim)`` in C order, native little-endian.
4. ``STATE`` (sender -> receiver), only when the HELLO announced ``state_bytes``: the
   request's fixed-size state (a hybrid model's linear-attention states and window KV, which
   the emulated card has and the small real model lacks: zeros of the card's size, scaled to
   the wire like the KV), in frames of at most ``STATE_FRAME`` bytes after the last BLOCK.
5. ``END`` (sender -> receiver, JSON ``End``): the first generated token and the count.
6. ``ACK`` (receiver -> sender, JSON ``Ack``): ``{"ok": true}`` or ``{"error": ...}``.

A transfer may run over several connections (``kv_connections``: parallel TCP streams
sharing the line, as a transfer engine on commodity Ethernet opens them). Its HELLO says how
many at most (``stripes``); the receiver's OFFER then carries a ``key`` (random, 128 bits,
given to this transfer's sender alone); each further connection, after its own AUTH, opens
with ``JOIN`` (JSON ``Join``: the key and its stripe number 1..stripes-1) and carries BLOCK
frames, then END, answered by ACK. Frame ``j`` of a transfer travels on stripe
``j % stripes``; the receiver takes blocks in any order across stripes, each exactly once, and
answers the first connection's END only once every block has come.

``EXTEND`` (JSON token IDs to recompute) is used only by ``testbed bench handoff``, which
compares shipping KV blocks with shipping token IDs over the same framing; blocking-socket
versions of the framing (``send_frame`` / ``recv_frame``) serve it. Every frame type,
payload model and size cap lives here; nothing from a peer is used before it is validated.
"""

from __future__ import annotations

import functools
import socket
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.messages import MAX_PROMPT_TOKENS, RequestId, Ticket
from protocol.validation import first_error
from protocol.worker_config import MAX_KV_CONNECTIONS, MAX_LAYER_GROUPS

MAGIC = b"PDKV"
VERSION = 1
HDR = struct.Struct("!4sBBHI")
BLOCK_HDR = struct.Struct("!IIIHHHHBxxxI")
# One block per frame. 256-token frames cut the sender's Python work 16x (PDD's prefill
# overran 3-31 ms beside its sends) but changed cross-datacenter TTFT with the dilation in
# tests/test_fidelity.py (2.3 s at D 4 vs 1.7 s at D 8, twice): not understood yet, not used.
FRAME_TOKENS = 16
HELLO, OFFER, BLOCK, END, ACK, EXTEND, AUTH, STATE, JOIN = 1, 2, 3, 4, 5, 6, 7, 8, 9
MAX_STRIPES = MAX_KV_CONNECTIONS  # connections one transfer may use
STATE_FRAME = 256 * 1024
MAX_STATE_BYTES = 1 << 30  # a request's state on the wire (the emulated card's, scaled): far above any card's
DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {str(d): d for d in DTYPE_CODES}  # "torch.float32" -> torch.float32: the only dtypes read
MAX_TOKEN_ID = (1 << 31) - 1
MAX_CONTROL_FRAME = 64 * 1024  # OFFER, END, ACK: a few small JSON fields
MAX_HELLO = 1024 + 12 * MAX_PROMPT_TOKENS  # JSON token ids of at most 10 digits and ", "
# A connection's first frame: the run's KV token, alone and small, so a stranger is refused
# after at most this many bytes (not a HELLO's megabytes) and within AUTH_TIMEOUT_S.
MAX_AUTH = 512
AUTH_TIMEOUT_S = 5.0  # real seconds: a legitimate AUTH follows the connect at once, even over a lossy line


class KVTransferError(Exception):
    pass


class KVRefused(KVTransferError):
    """The receiver will not take this transfer from this sender (its HELLO lacks the
    request's ticket), and the request is not failed for it: the request's own sender may
    still come. A stranger's or a rogue's offer costs the request nothing."""


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
    # The request's ticket for this receiver: the router gave it to this transfer's sender and
    # receiver alone (their commands), so another worker of the run cannot offer this KV.
    ticket: Ticket = ""
    # The request's fixed-size state, sent as STATE frames after the KV (0: a model without).
    state_bytes: int = Field(default=0, ge=0, le=MAX_STATE_BYTES)
    # Connections the transfer may use (JOIN); 1: this one alone.
    stripes: int = Field(default=1, ge=1, le=MAX_STRIPES)
    # Layer groups its blocks carry (``layer_bounds``; per-layer transfers); 1: every block all layers.
    layer_groups: int = Field(default=1, ge=1, le=MAX_LAYER_GROUPS)

    def wire(self) -> bytes:
        """The frame's JSON; ``state_bytes``, ``stripes`` and ``layer_groups`` only when not
        their defaults (a dense model's HELLO over one connection, all layers per block, is what
        it was before any of them)."""
        left_out = {k for k, v in (("state_bytes", self.state_bytes), ("stripes", self.stripes - 1),
                                   ("layer_groups", self.layer_groups - 1)) if not v}
        return self.model_dump_json(exclude=left_out or None).encode()

    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.kv_heads, self.head_dim, DTYPE_NAMES[self.dtype])


class Auth(_Frame):
    token: str = Field(default="", max_length=256)  # the run's KV token (only the run's workers know it)


JoinKey = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class Offer(_Frame):
    have: int | None = Field(default=None, ge=0)
    error: str | None = None
    key: JoinKey | None = None  # a transfer over several connections: what its other connections JOIN with


class Join(_Frame):
    """A further connection of a transfer (after its AUTH): the key its OFFER gave, its stripe."""

    key: JoinKey
    stripe: int = Field(ge=1, le=MAX_STRIPES - 1)


class End(_Frame):
    first_token: int = Field(ge=0, le=MAX_TOKEN_ID)
    n: int = Field(ge=1, le=MAX_PROMPT_TOKENS)


class Ack(_Frame):
    ok: bool = False
    error: str | None = None


def parse_frame(model: type[F], payload: bytes, what: str) -> F:
    try:
        return model.model_validate_json(payload)
    except ValidationError as e:
        raise KVTransferError(f"bad {what}: {first_error(e, 'frame')}") from None


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


def encode_block(idx: int, start: int, part: torch.Tensor, corrupt: bool = False, layer0: int = 0) -> tuple[bytes, int]:
    """A BLOCK frame's payload for ``part`` = KV of tokens ``[start, start + n)`` of layers
    ``[layer0, layer0 + part's layers)``, and its tensor byte count. ``corrupt`` flips a byte
    after the checksum (fault injection)."""
    data = _tensor_bytes(part)
    crc = zlib.crc32(data)
    if corrupt:
        data = bytes([data[0] ^ 0xFF]) + data[1:]
    layers, _, heads, n, head_dim = part.shape
    hdr = BLOCK_HDR.pack(idx, start, n, layer0, layer0 + layers, heads, head_dim, DTYPE_CODES[part.dtype], crc)
    return hdr + data, len(data)


@functools.lru_cache(maxsize=64)
def _zero_payload(layers: int, heads: int, n: int, head_dim: int, dtype: torch.dtype) -> tuple[bytes, int]:
    data = bytes(layers * 2 * heads * n * head_dim * torch.finfo(dtype).bits // 8)
    return data, zlib.crc32(data)


def encode_zero_block(idx: int, start: int, part: torch.Tensor, corrupt: bool = False,
                      layer0: int = 0) -> tuple[bytes, int]:
    """``encode_block`` for KV known to be all zeros (a modeled worker's, ``workers/modeled.py``):
    the same frame, with the payload and checksum of each shape computed once. A modeled
    prefill ships its KV at emulated rates: copying and checksumming megabytes of zeros per
    request cost that worker more than its steps."""
    layers, _, heads, n, head_dim = part.shape
    data, crc = _zero_payload(layers, heads, n, head_dim, part.dtype)
    if corrupt:
        data = b"\xff" + data[1:]
    hdr = BLOCK_HDR.pack(idx, start, n, layer0, layer0 + layers, heads, head_dim, DTYPE_CODES[part.dtype], crc)
    return hdr + data, len(data)


def layer_bounds(layers: int, groups: int) -> tuple[int, ...]:
    """Where a model's layers split into ``groups`` groups of (nearly) equal size, first layer
    of each then the layer count: the only layer ranges a per-layer transfer's blocks may
    carry (``kv_transfer: per-layer``)."""
    return tuple(round(i * layers / groups) for i in range(groups + 1))


@dataclass
class Block:
    first: int  # first token
    kv: torch.Tensor  # (layers of the block, 2, kv_heads, tokens, head_dim)
    layer0: int = 0  # its first layer


def _block_header(payload: bytes, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                  bounds: Sequence[int] = ()) -> tuple[int, int, int, int, int]:
    """(first token, token count, checksum, first layer, layer end) of a BLOCK payload whose
    header matches the receiver's layout (all its layers, or with ``bounds`` one group of
    them: ``layer_bounds``) and whose length matches its count. Raises KVTransferError."""
    if len(payload) < BLOCK_HDR.size:
        raise KVTransferError(f"block frame of {len(payload)} bytes is shorter than its header")
    _, first, count, l0, l1, b_heads, hd, code, crc = BLOCK_HDR.unpack_from(payload)
    whole = (l0, l1) == (0, layers) if not bounds else l0 in bounds[:-1] and l1 == bounds[bounds.index(l0) + 1]
    if not whole or (b_heads, hd) != (heads, head_dim) or CODE_DTYPES.get(code) != dtype:
        raise KVTransferError(f"block at token {first}: unexpected shape/dtype (layers {l0}-{l1})")
    per_token = (l1 - l0) * 2 * heads * head_dim * torch.finfo(dtype).bits // 8
    if count < 1 or len(payload) - BLOCK_HDR.size != count * per_token:
        raise KVTransferError(f"block at token {first}: {len(payload) - BLOCK_HDR.size} bytes for {count} tokens")
    return first, count, crc, l0, l1


def decode_block(payload: bytes, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                 bounds: Sequence[int] = ()) -> Block:
    """Verify (length, checksum, shape, dtype) and decode a BLOCK payload. Raises KVTransferError."""
    first, count, crc, l0, l1 = _block_header(payload, layers, heads, head_dim, dtype, bounds)
    data = payload[BLOCK_HDR.size :]
    if zlib.crc32(data) != crc:
        raise KVTransferError(f"block at token {first}: checksum mismatch")
    return Block(first, torch.frombuffer(bytearray(data), dtype=dtype).view(l1 - l0, 2, heads, count, head_dim), l0)


def check_block_span(payload: bytes, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                     bounds: Sequence[int] = ()) -> tuple[int, int, int, int]:
    """``decode_block``'s checks without decoding, for a modeled receiver (which keeps no KV):
    (first token, token count, first layer, layer end). A modeled sender's data is zeros,
    recognised by comparing the frame with a cached zero payload of that size and its known
    checksum, ~15x cheaper than a checksum pass; other data is checksummed. Raises
    KVTransferError."""
    first, count, crc, l0, l1 = _block_header(payload, layers, heads, head_dim, dtype, bounds)
    zeros, zero_crc = _zero_payload(l1 - l0, heads, count, head_dim, dtype)
    if crc == zero_crc and payload.endswith(zeros):
        return first, count, l0, l1
    if zlib.crc32(memoryview(payload)[BLOCK_HDR.size :]) != crc:
        raise KVTransferError(f"block at token {first}: checksum mismatch")
    return first, count, l0, l1


def check_block(payload: bytes, layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """``check_block_span`` of a block of all layers: (first token, token count)."""
    return check_block_span(payload, layers, heads, head_dim, dtype)[:2]
