"""The router's prefix index evicts exactly as a least-recently-used ordered dict would, and
holds its order of use in bounded memory."""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from testbed.policies.prefix_index import PrefixIndex
from workers.radix_cache import RadixCache


class _Reference:
    """The index as it was: an ordered dict of block prefixes, moved to the end on use."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.bs, self.cap, self.blocks = block_size, capacity_tokens // block_size, OrderedDict()

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (i + 1) * self.bs]) for i in range(len(tokens) // self.bs)]

    def match(self, tokens: list[int]) -> int:
        n = 0
        for k in self._keys(tokens):
            if k not in self.blocks:
                break
            n += 1
        return n * self.bs

    def insert(self, tokens: list[int]) -> None:
        for k in self._keys(tokens):
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.cap:
            self.blocks.popitem(last=False)


def test_the_index_evicts_and_matches_as_an_lru_ordered_dict() -> None:
    """Prompts that share prefixes and grow (sessions), inserted and looked up in a random
    order through many evictions and rewrites of the order of use: every match and size is
    the reference's."""
    rng = random.Random(7)
    bases = [[rng.randrange(8) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    for cap in (0, 4, 24, 96):
        idx, ref = PrefixIndex(4, cap), _Reference(4, cap)
        for step in range(3000):
            prompt = rng.choice(bases) + [rng.randrange(8) for _ in range(rng.randrange(0, 30))]
            if rng.random() < 0.5:
                idx.insert(prompt)
                ref.insert(prompt)
            probe = rng.choice(bases) + prompt[rng.randrange(0, len(prompt) + 1):]
            assert idx.match(probe) == ref.match(probe), (cap, step)
            assert len(idx) == len(ref.blocks), (cap, step)
        # The order of use keeps at most about twice the live blocks (and a slack).
        assert sum(len(h) for _, h in idx._uses) <= 2 * len(idx) + 4096 + 30


def test_a_prompt_used_again_and_again_keeps_the_order_of_use_bounded() -> None:
    """Sessions re-send the same long prefix every turn: each insert lists its blocks again,
    and the entries of earlier uses are rewritten away rather than piling up."""
    idx = PrefixIndex(16, 1 << 20)
    prompt = list(range(16 * 1000))
    for _ in range(50):
        idx.insert(prompt)
    assert len(idx) == 1000 and idx.match(prompt) == 16 * 1000
    assert sum(len(h) for _, h in idx._uses) <= 2 * 1000 + 4096


def test_a_hybrid_prefills_shadow_matches_only_where_its_cache_kept_a_state() -> None:
    """With ``exact_states`` the index says what a hybrid model's prefill cache would resume
    from (``RadixCache(exact_states=True)``): sessions that grow, prompts that share a head
    and diverge, in a random order; every match equals the cache's."""
    rng = random.Random(3)
    heads = [[rng.randrange(1, 8000) for _ in range(rng.choice([16, 40, 100]))] for _ in range(4)]
    sessions = [list(rng.choice(heads)) for _ in range(12)]
    index, cache = PrefixIndex(16, 1 << 20, exact_states=True), RadixCache(16, 1 << 20, keeps_kv=False,
                                                                             exact_states=True)
    plain = PrefixIndex(16, 1 << 20)
    shorter = 0
    for _ in range(300):
        s = rng.randrange(len(sessions))
        sessions[s] = sessions[s] + [rng.randrange(1, 8000) for _ in range(rng.randrange(1, 60))]
        prompt = sessions[s]
        assert index.match(prompt) == len(cache.match_prefix(prompt, count=False)) * 16
        shorter += index.match(prompt) < plain.match(prompt)
        index.insert(prompt)
        plain.insert(prompt)
        cache.insert(prompt, torch.zeros(1, 2, 1, len(prompt), 1))
    assert shorter > 0  # some shared heads matched in the plain index and not at a kept state
