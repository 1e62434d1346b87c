"""The one workload shape every trace format is loaded into, and how it becomes requests.

A ``Workload`` is a list of ``TraceRequest`` in file order. A request's prompt is not
stored as token IDs but as a recipe: a list of ``Segment`` (a deterministic token stream
named by a key, cut to a length). Requests that share leading segments share their leading
tokens exactly, so prefix reuse in the trace becomes prefix reuse in the workers' caches,
and statistics (block hit rates) are computed from recipes without materialising millions
of tokens. Token IDs are made only for the requests that are replayed.

A request is sent either at an offset from the replay's start (``at``, open loop) or a
delay after another request of its session completes (``after`` + ``delay``, closed loop).
``Workload.specs`` materialises the replayed requests as ``RequestSpec``: token IDs,
timing and the hints the router's policy may read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from protocol.messages import RequestHints

VOCAB_LOW, VOCAB_HIGH = 3, 8192  # ids 0..2 are pad/bos/eos in the default model (vocabulary 8192)


def synth_tokens(key: str, n: int) -> list[int]:
    """``n`` token IDs determined by ``key``; a shorter cut is a prefix of a longer one (the
    generator's bytes are drawn in order, four per id). A 64K-token context is made in a few
    milliseconds (``randrange`` per id took 50x longer)."""
    words = np.frombuffer(random.Random(key).randbytes(4 * n), dtype="<u4")
    return (words % np.uint32(VOCAB_HIGH - VOCAB_LOW) + np.uint32(VOCAB_LOW)).tolist()


@functools.lru_cache(maxsize=512)
def _segment_tokens(key: str, n: int) -> tuple[int, ...]:
    return tuple(synth_tokens(key, n))


@dataclass(frozen=True)
class Segment:
    """``n`` tokens of the stream named ``key`` from its token ``skip`` on (or the literal
    token IDs given)."""

    key: str
    n: int
    literal: tuple[int, ...] | None = None
    skip: int = 0  # a prompt truncated at its head (``tail``) starts inside a stream

    @property
    def stream(self) -> str:
        """What the segment's tokens are a prefix of: two segments share tokens from their
        first on only if their streams are the same."""
        return self.key if not self.skip else f"{self.key}@{self.skip}"

    def tokens(self) -> tuple[int, ...]:
        if self.literal is not None:
            return self.literal
        return _segment_tokens(self.key, self.n) if not self.skip else _segment_tokens(self.key, self.skip + self.n)[
            self.skip:]


@dataclass
class TraceRequest:
    rid: str
    segments: list[Segment]
    output_len: int
    at: float | None = None  # open loop: seconds after the replay starts
    after: str | None = None  # closed loop: sent ``delay`` s after this request completes
    delay: float = 0.0
    also_after: tuple[str, ...] = ()  # closed loop: and after these (an agent waiting on several calls)
    session: str | None = None
    turn: int = 0
    line: int = 0  # where it came from, for messages
    hints: RequestHints = field(default_factory=RequestHints)
    answer: Segment | None = None  # the stand-in for its answer that the session's next turn carries

    @property
    def input_len(self) -> int:
        return sum(s.n for s in self.segments)

    def prompt(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out.extend(s.tokens())
        return out

    def lazy_prompt(self) -> Prompt:
        return Prompt(self.segments)


class Prompt(Sequence[int]):
    """A prompt's token ids made when they are read: a replay of 1,000 requests of 64K tokens
    held 2.3 GB of ids as lists (an int object each) before the first was sent; a client needs
    each prompt only while it sends it."""

    __slots__ = ("segments", "_len")

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self._len = sum(s.n for s in segments)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(s.tokens() for s in self.segments)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        return list(self)[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class RequestSpec:
    """A request as the client replays it."""

    rid: str
    prompt: Sequence[int]  # a list, or a ``Prompt`` made from the trace's recipe when read
    max_new: int
    at: float = 0.0  # seconds after the replay starts (open loop)
    hints: RequestHints = field(default_factory=RequestHints)
    after: str | None = None  # closed loop: sent ``delay`` s after request ``after`` completes
    delay: float = 0.0
    also_after: tuple[str, ...] = ()  # ... and every one of these
    # ``hints.answer`` as the client sends it, made then (a ``Prompt``): an hour at token scale
    # 1 is 10.8 M answer tokens, ~360 MB as lists held from the first request to the last.
    answer: Sequence[int] | None = None

    def sent_hints(self) -> RequestHints:
        return self.hints if self.answer is None else self.hints.model_copy(update={"answer": list(self.answer)})


@dataclass
class Workload:
    source: Path
    format: str
    requests: list[TraceRequest]
    token_scale: int = 1
    block_size: int = 512  # the trace's prefix block (Mooncake: 512 tokens), after scaling
    meta: dict[str, Any] = field(default_factory=dict)

    def first_sent(self) -> dict[str, float]:
        """Estimated send offset of each request (closed-loop turns: predecessor's + delay)."""
        est: dict[str, float] = {}
        for r in self.requests:
            if r.at is not None:
                est[r.rid] = r.at
            else:
                est[r.rid] = max(est.get(p, 0.0) for p in (r.after or "", *r.also_after)) + r.delay
        return est

    def select(self, limit: int | None = None, window: tuple[float, float] | None = None) -> Workload:
        """A slice: requests whose (estimated) send time lies in ``window`` (shifted to start at
        0), then the first ``limit`` of them. A closed-loop turn whose predecessor was cut
        away is sent at the predecessor's estimated time instead."""
        est = self.first_sent()
        keep = self.requests
        shift = 0.0
        if window is not None:
            lo, hi = window
            keep = [r for r in keep if lo <= est[r.rid] < hi]
            shift = lo
        keep = sorted(keep, key=lambda r: est[r.rid])  # stable: file order among equals
        if limit is not None:
            keep = keep[:limit]
        kept = {r.rid for r in keep}
        out = []
        for r in keep:
            r2 = dataclasses.replace(r)
            if r2.at is not None:
                r2.at = r2.at - shift
            waits = [p for p in (r2.after, *r2.also_after) if p is not None and p in kept]
            if r2.after is not None and waits and waits[0] != r2.after:  # its first one cut away: the next
                r2.after, r2.also_after = waits[0], tuple(waits[1:])
            elif r2.also_after:
                r2.also_after = tuple(waits[1:])
            if r2.after is not None and not waits:  # (a tree's child keeps its own time)
                r2.at = max(0.0, r2.at if r2.at is not None else est[r.rid] - shift)
                r2.after, r2.delay = None, 0.0
            out.append(r2)
        return dataclasses.replace(self, requests=out)

    def capped(self, max_context: int | None) -> Workload:
        """Each prompt longer than ``max_context`` emulated tokens keeps its last ones, as a
        serving engine truncates a prompt to its context (vLLM's ``truncate_prompt_tokens``);
        how many were truncated and the tokens dropped go in ``meta["max_context"]``."""
        if max_context is None:
            return self
        if max_context < 1:
            raise ValueError(f"max context {max_context}: at least 1 token")
        cap = scale_len(max_context, self.token_scale)
        out, truncated, dropped = [], 0, 0
        for r in self.requests:
            n = r.input_len
            if n > cap:
                truncated += 1
                dropped += n - cap
                r = dataclasses.replace(r, segments=tail(r.segments, cap))
            out.append(r)
        meta = {**self.meta, "max_context": {"tokens": max_context, "truncated": truncated, "of": len(out),
                                             "dropped_tokens": dropped * self.token_scale}}
        return dataclasses.replace(self, requests=out, meta=meta)

    def specs(self, speed: float = 1.0) -> list[RequestSpec]:
        """Materialise prompts and timing (``speed`` 2 = twice as fast) for the client."""
        out = []
        for r in self.requests:
            hints = r.hints.model_copy(update={"session": r.session, "turn": r.turn})
            out.append(RequestSpec(r.rid, r.lazy_prompt(), r.output_len,
                                   at=(r.at or 0.0) / speed if r.at is not None else 0.0,
                                   hints=hints, after=r.after, delay=r.delay / speed, also_after=r.also_after,
                                   answer=Prompt([r.answer]) if r.answer else None))
        return out


def hashed_blocks(namespace: str, hash_ids: Sequence[int], want: int, block: int) -> list[Segment]:
    """A prompt of ``want`` tokens made of a trace's hashed blocks of ``block`` tokens (equal
    ids in one ``namespace`` are equal content, so shared prefixes are cached as published)."""
    segs: list[Segment] = []
    for h in hash_ids:
        take = min(block, want - sum(s.n for s in segs))
        if take > 0:
            segs.append(Segment(f"{namespace}:{h}:{block}", take))
    return segs


def cut(segments: list[Segment], n: int) -> list[Segment]:
    """The first ``n`` tokens of ``segments`` (a shorter cut of a stream is its prefix): how a
    trace that gives a shared prefix as a count (TraceLab, Copilot) takes it from a session's
    context."""
    out: list[Segment] = []
    for s in segments:
        if n <= 0:
            break
        take = min(s.n, n)
        out.append(s if take == s.n else Segment(s.key, take, s.literal[:take] if s.literal else None, s.skip))
        n -= take
    return out


def tail(segments: list[Segment], n: int) -> list[Segment]:
    """The last ``n`` tokens of ``segments``, the same token ids. A prompt truncated inside a
    segment shares a prefix with another only if that one was truncated at the same point of
    the same stream (``Segment.stream``), as in a prefix cache."""
    drop = sum(s.n for s in segments) - n
    out: list[Segment] = []
    for s in segments:
        if drop >= s.n:
            drop -= s.n
            continue
        if drop > 0:
            s = Segment(s.key, s.n - drop, s.literal[drop:] if s.literal is not None else None, s.skip + drop)
            drop = 0
        out.append(s)
    return out


def scale_len(n: int, scale: int) -> int:
    """A length divided by the token scale, never below 1 token."""
    return max(1, math.ceil(n / scale))


def block_hashes(segments: list[Segment], block: int) -> list[bytes]:
    """Chained content hashes of each *full* block of a prompt (as a prefix cache keys them)."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    filled = 0
    for s in segments:
        pos = 0
        while pos < s.n:
            take = min(block - filled, s.n - pos)
            piece = s.literal[pos : pos + take] if s.literal is not None else (s.key, s.skip + pos, take)
            h.update(repr(piece).encode())
            filled += take
            pos += take
            if filled == block:
                digest = h.digest()
                out.append(digest)
                h = hashlib.blake2b(digest, digest_size=16)
                filled = 0
    return out
