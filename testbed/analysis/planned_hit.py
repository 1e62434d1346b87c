"""The prefix hit a run planned: per request, the share of its prompt an unbounded prefix cache
would have held (``planned_hits``), set beside the share its prefill got (``metrics``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from testbed.deploy.run_record import ClientRecord
from testbed.traces.workload import Prompt, RequestSpec


def planned_hits(recs: dict[str, ClientRecord], specs: list[RequestSpec], block: int,
                 outputs_cached: bool) -> dict[str, float]:
    """Per request: the share of its prompt an unbounded prefix cache of ``block``-token blocks
    would hold, had it kept every prompt sent before it (in the order the client sent them)
    and, where the scenario caches answers, their answers: what the trace let a run hit, to
    set beside what the prefill that served it held. Prompts made from a trace's recipe are
    compared segment by segment (``_Recipes``: memory by segments, not tokens: an emulated hour
    at token scale 1 is 400 M prompt tokens); others token by token in chained blocks."""
    sent = sorted((r.sent, s.rid, s) for s in specs if (r := recs.get(s.rid)) is not None and r.sent)
    recipes = all(isinstance(s.prompt, Prompt) and (s.answer is None or isinstance(s.answer, Prompt))
                  for _, _, s in sent)
    cache: _Recipes | _Blocks = _Recipes() if recipes else _Blocks(block)
    out: dict[str, float] = {}
    for _, rid, spec in sent:
        shared = cache.shared(spec.prompt)
        out[rid] = shared // block * block / len(spec.prompt) if len(spec.prompt) else 0.0
        cache.add(spec.prompt, spec.answer if outputs_cached else None)
    return out


class _Recipes:
    """Prompts as recipes (``Prompt``: segments of named token streams): a trie of segments
    whose nodes keep, per stream, the longest cut seen there; the tokens a prompt shares with
    any earlier one are found walking it (a shorter cut of a stream is a prefix of a longer)."""

    def __init__(self) -> None:
        self.root: tuple[dict[str, int], dict[tuple[str, int], Any]] = ({}, {})

    def shared(self, prompt: Prompt) -> int:
        node, got = self.root, 0
        for seg in prompt.segments:
            most = node[0].get(seg.stream, 0)
            got += min(seg.n, most)
            child = node[1].get((seg.stream, seg.n)) if most >= seg.n else None
            if child is None:
                break
            node = child
        return got

    def add(self, prompt: Prompt, answer: Prompt | None) -> None:
        node = self.root
        for seg in [*prompt.segments, *(answer.segments if answer is not None else [])]:
            node[0][seg.stream] = max(node[0].get(seg.stream, 0), seg.n)
            node = node[1].setdefault((seg.stream, seg.n), ({}, {}))


class _Blocks:
    """Prompts as token ids: chained digests of their whole blocks, as a prefix cache keys them."""

    def __init__(self, block: int) -> None:
        self.block, self.seen = block, set[bytes]()

    def shared(self, prompt: Sequence[int]) -> int:
        hashes = _block_chain(np.fromiter(prompt, dtype="<u4", count=len(prompt)), self.block)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.seen:
            hit += 1
        return hit * self.block

    def add(self, prompt: Sequence[int], answer: Sequence[int] | None) -> None:
        tokens = np.fromiter(prompt, dtype="<u4", count=len(prompt))
        if answer is not None:
            tokens = np.concatenate([tokens, np.fromiter(answer, dtype="<u4", count=len(answer))])
        self.seen.update(_block_chain(tokens, self.block))


def _block_chain(tokens: np.ndarray, block: int) -> list[bytes]:
    """Chained digests of each whole block of ``tokens``."""
    out, h = [], b""
    for i in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(h + tokens[i : i + block].tobytes(), digest_size=16).digest()
        out.append(h)
    return out
