"""The token stream's hot path: one binary message per worker and step.

A decode step produces one token for every request in the batch. Sent as one JSON message
per request (``Tokens``), a step of 20 requests cost 20 pydantic models, 20 tasks, 20 MQTT
publishes, 20 broker deliveries and 20 validations at the client. A worker now buffers the
step's chunks and sends them together as one batch on its own topic (``stream/<worker>``),
in the compact layout below; the receiver decodes and checks every
field before it touches a record, and a batch that fails names the requests it could read so
that only those fail.

Layout, little-endian::

    batch   magic "PTS1" | t: f64 | len(worker): u8 | chunks: u16 | worker: ascii
    chunk   len(rid): u8 | rid: ascii | start: u32 | flags: u8 | n: u32 | n x token: u32
            [ len(error): u16 | error: utf-8 ]        only when flags has ERROR

Flags: 1 = done (the request's last chunk), 2 = error (the request failed; implies done).
Names follow the control plane's rule (``SAFE_NAME``). ``TokenChunk`` is the one type both
this path and the router's JSON ``Tokens`` (a failure it reports itself) become at the
receiver; ``protocol.stream_gate`` reads both kinds and keeps a request's chunks to the
workers the router named for it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from protocol.messages import SAFE_NAME, Tokens

MAGIC = b"PTS1"
DONE, ERROR = 1, 2
MAX_CHUNKS = 0xFFFF
MAX_ERROR_BYTES = 0xFFFF

_HEAD = struct.Struct("<4sdBH")
_CHUNK = struct.Struct("<IBI")  # start, flags, n (after the rid)
_ERRLEN = struct.Struct("<H")
_NAME = re.compile(SAFE_NAME)
# Names (workers', requests') already checked, by their bytes: a request's id recurs in every
# step's batch while it decodes. Cleared when full (a run of 10^5 requests is many more).
_NAMES: dict[bytes, str] = {}
NAMES_KEPT = 1 << 14
_IDS: dict[int, struct.Struct] = {}
IDS_KEPT = 256


class TokenStreamError(ValueError):
    """A token batch that failed validation; ``rids`` are the requests it named before the
    fault (each is failed, the rest of the stream goes on)."""

    def __init__(self, why: str, rids: list[str]) -> None:
        super().__init__(why)
        self.rids = rids


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens ``start..start+len(tokens)`` of one request's output, from one worker."""

    rid: str
    start: int
    tokens: list[int]
    worker: str
    done: bool = False
    error: str | None = None


def chunk_of(t: Tokens) -> TokenChunk:
    """The router's JSON ``Tokens`` (a failure it reports itself) as a chunk."""
    return TokenChunk(t.rid, t.start, t.tokens, t.worker, t.done or t.error is not None, t.error)


def encode(worker: str, t: float, chunks: list[TokenChunk]) -> bytes:
    """One batch from ``worker``'s chunks (all from this worker, in stream order)."""
    if not chunks or len(chunks) > MAX_CHUNKS:
        raise ValueError(f"a token batch carries 1 to {MAX_CHUNKS} chunks, not {len(chunks)}")
    w = worker.encode("ascii")
    parts = [_HEAD.pack(MAGIC, t, len(w), len(chunks)), w]
    for c in chunks:
        r = c.rid.encode("ascii")
        flags = (DONE if c.done or c.error is not None else 0) | (ERROR if c.error is not None else 0)
        parts += [bytes((len(r),)), r, _CHUNK.pack(c.start, flags, len(c.tokens)),
                  _ids(len(c.tokens)).pack(*c.tokens)]
        if c.error is not None:
            e = c.error.encode()[:MAX_ERROR_BYTES]
            parts += [_ERRLEN.pack(len(e)), e]
    return b"".join(parts)


def decode(payload: bytes | bytearray) -> tuple[str, float, list[TokenChunk]]:
    """(worker, send time, chunks) of one batch; raises ``TokenStreamError`` naming the
    field that failed and the requests read before it. Every step of every decoder passes
    here: fields are read in place (``unpack_from``), and names already checked are looked up."""
    buf = bytes(payload)
    size = len(buf)
    rids: list[str] = []

    def fail(why: str) -> TokenStreamError:
        return TokenStreamError(f"token batch: {why}", rids)

    def short(off: int, n: int, what: str) -> TokenStreamError:
        return fail(f"{what}: truncated at byte {off} (needs {n} more of {size - off})")

    def name(off: int, n: int, what: str) -> str:
        if off + n > size:
            raise short(off, n, what)
        raw = buf[off : off + n]
        s = _NAMES.get(raw)
        if s is None:
            s = raw.decode("ascii", errors="replace")
            if not _NAME.fullmatch(s):
                raise fail(f"{what}: {s[:40]!r} is not a valid name")
            if len(_NAMES) >= NAMES_KEPT:
                _NAMES.clear()
            _NAMES[raw] = s
        return s

    if size < _HEAD.size:
        raise short(0, _HEAD.size, "header")
    magic, t, wlen, n_chunks = _HEAD.unpack_from(buf)
    off = _HEAD.size
    if magic != MAGIC:
        raise fail(f"header: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if not n_chunks:
        raise fail("header: no chunks")
    if t != t or t < 0:
        raise fail(f"header: send time {t} is not a time")
    worker = name(off, wlen, "worker")
    off += wlen
    chunks: list[TokenChunk] = []
    for i in range(n_chunks):
        if off >= size:
            raise short(off, 1, f"chunk {i} rid length")
        rlen = buf[off]
        rid = name(off + 1, rlen, f"chunk {i} rid")
        off += 1 + rlen
        rids.append(rid)
        if off + _CHUNK.size > size:
            raise short(off, _CHUNK.size, f"chunk {i} ({rid})")
        start, flags, n = _CHUNK.unpack_from(buf, off)
        off += _CHUNK.size
        if flags & ~(DONE | ERROR):
            raise fail(f"chunk {i} ({rid}): unknown flags {flags:#x}")
        if flags & ERROR and not flags & DONE:
            raise fail(f"chunk {i} ({rid}): an error that does not end the stream")
        if off + 4 * n > size:
            raise short(off, 4 * n, f"chunk {i} ({rid}) tokens")
        tokens = list(_ids(n).unpack_from(buf, off))
        off += 4 * n
        error = None
        if flags & ERROR:
            if off + _ERRLEN.size > size:
                raise short(off, _ERRLEN.size, f"chunk {i} ({rid}) error length")
            (elen,) = _ERRLEN.unpack_from(buf, off)
            off += _ERRLEN.size
            if off + elen > size:
                raise short(off, elen, f"chunk {i} ({rid}) error")
            try:
                error = buf[off : off + elen].decode()
            except UnicodeDecodeError as e:
                raise fail(f"chunk {i} ({rid}) error: not UTF-8 ({e.reason})") from None
            off += elen
        chunks.append(TokenChunk(rid, start, tokens, worker, bool(flags & DONE), error))
    if off != size:
        raise fail(f"{size - off} bytes after the last chunk")
    return worker, t, chunks


def _ids(n: int) -> struct.Struct:
    """The layout of ``n`` token ids, compiled once for the counts that recur (a step's
    chunk is one token; a relay's first chunk, its eager tokens)."""
    s = _IDS.get(n)
    if s is None:
        s = struct.Struct(f"<{n}I")
        if len(_IDS) < IDS_KEPT:
            _IDS[n] = s
    return s
