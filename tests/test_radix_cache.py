"""The radix cache's heap-based eviction against the obvious LRU scan it replaced, and its
cost on a full cache (no network)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from workers.radix_cache import Node, RadixCache


def _kv(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1).expand(1, 2, 1, n, 1).contiguous()


class ScanLru(RadixCache):
    """The reference: every eviction walks the tree for the least recently used unlocked leaf."""

    def _evict_one(self, protect: Node | None) -> bool:
        keep = set()
        n = protect
        while n is not None:
            keep.add(id(n))
            n = n.parent
        leaves = [x for x in self._iter() if x.leaf and x.lock == 0 and id(x) not in keep]
        if not leaves:
            return False
        victim = min(leaves, key=lambda x: x.last_used)
        assert victim.parent is not None
        victim.parent.remove(victim)
        self.blocks -= 1
        self.evicted_blocks += 1
        return True


def _contents(c: RadixCache) -> set[tuple[tuple[int, ...], ...]]:
    out = set()
    for n in c._iter():
        path, x = [], n
        while x is not None and x is not c.root:
            path.append(x.key)
            x = x.parent
        out.add(tuple(reversed(path)))
    return out


def test_heap_eviction_evicts_exactly_what_an_lru_scan_evicts() -> None:
    rng = random.Random(11)
    fast, ref = RadixCache(block_size=2, capacity_tokens=40), ScanLru(block_size=2, capacity_tokens=40)
    locked: list[tuple[list[Node], list[Node]]] = []
    for step in range(3000):
        # Prompts over a tiny alphabet share prefixes, so the tree branches and leaves change.
        prompt = [rng.randrange(3) for _ in range(2 * rng.randint(1, 8))]
        op = rng.random()
        if op < 0.5:
            assert fast.insert(prompt, _kv(len(prompt))) == ref.insert(prompt, _kv(len(prompt))), step
        elif op < 0.7:
            a, b = fast.match_prefix(prompt), ref.match_prefix(prompt)
            assert [n.key for n in a] == [n.key for n in b]
            fast.lock(a)
            ref.lock(b)
            locked.append((a, b))
        elif op < 0.9 and locked:
            a, b = locked.pop(rng.randrange(len(locked)))
            fast.unlock(a)
            ref.unlock(b)
        else:
            k = 2 * rng.randint(1, 4)
            assert fast.evict(k) == ref.evict(k), step
        assert _contents(fast) == _contents(ref), step
        assert fast.blocks == ref.blocks == len(_contents(fast))


def test_a_full_cache_evicts_in_logarithmic_time() -> None:
    """16K blocks, full: inserting 2,000 new blocks evicts 2,000 (the scan it replaced walked
    all 16K nodes per eviction: ~30 s here). A generous bound: this asserts the order of
    growth, not this machine's speed."""
    bs, blocks = 16, 16384
    c = RadixCache(block_size=bs, capacity_tokens=bs * blocks)
    kv = _kv(bs * 64)
    for i in range(blocks // 64):
        c.insert([i, *range(bs * 64 - 1)], kv)
    assert c.blocks == blocks
    t0 = time.perf_counter()
    for i in range(2000 // 64 + 1):
        c.insert([10**6 + i, *range(bs * 64 - 1)], kv)
    per_block = (time.perf_counter() - t0) / ((2000 // 64 + 1) * 64)
    assert c.blocks == blocks and c.evicted_blocks >= 2000
    assert per_block < 2e-3, f"{1e3 * per_block:.3f} ms per inserted block"


def test_an_insert_after_its_match_stores_what_a_walk_from_the_root_stores() -> None:
    """Prefill and decoder pass the path they matched (and held) to ``insert``, which starts
    after it: the tree, the depth returned and each block's KV are those of an insert that
    walks from the root, and a path evicted meanwhile is ignored, not trusted."""
    rng = random.Random(5)
    fast, ref = RadixCache(block_size=2, capacity_tokens=48), RadixCache(block_size=2, capacity_tokens=48)
    for step in range(3000):
        prompt = [rng.randrange(3) for _ in range(2 * rng.randint(1, 10))]
        kv = _kv(len(prompt)) + step
        a, b = fast.match_prefix(prompt), ref.match_prefix(prompt)
        assert [n.key for n in a] == [n.key for n in b], step
        if rng.random() < 0.2:  # released before the insert, and evicted: the path is stale
            assert fast.evict(48) == ref.evict(48), step
        else:
            fast.lock(a)
            ref.lock(b)
        assert fast.insert(prompt, kv, a) == ref.insert(prompt, kv), step
        if a and a[0].lock:
            fast.unlock(a)
            ref.unlock(b)
        assert _contents(fast) == _contents(ref), step
        path = fast.match_prefix(prompt, count=False)
        assert [n.key for n in path] == [n.key for n in ref.match_prefix(prompt, count=False)], step
        for i, (x, y) in enumerate(zip(path, ref.match_prefix(prompt, count=False), strict=True)):
            assert torch.equal(x.kv, y.kv), (step, i)


def test_keys_widen_once_an_id_needs_more_than_16_bits() -> None:
    """Keys hold 2 bytes an id until an id beyond 16 bits comes: then every key is rewritten
    to 4 and the cache goes on as one that held 4 from the start (same tree, same matches,
    same KV, the path held across the widening still usable)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(4) for _ in range(2 * rng.randint(1, 8))] for _ in range(40)]
    widened, wide = RadixCache(block_size=2, capacity_tokens=400), RadixCache(block_size=2, capacity_tokens=400)
    wide.match_prefix([70_000, 1])  # 4 bytes an id from the start
    for i, p in enumerate(prompts):
        assert widened.insert(p, _kv(len(p)) + i) == wide.insert(p, _kv(len(p)) + i)
    assert {len(n.key) for n in widened._iter()} == {4} and {len(n.key) for n in wide._iter()} == {8}
    held = widened.match_prefix(prompts[0])
    widened.lock(held)
    big = [*prompts[0], 70_000, 65_536]
    assert widened.insert(big, _kv(len(big)), held) == wide.insert(big, _kv(len(big)))
    widened.unlock(held)
    assert {len(n.key) for n in widened._iter()} == {8}
    assert _contents(widened) == _contents(wide)
    for p in [*prompts, big, [3, 3, 70_000, 2]]:
        a, b = widened.match_prefix(p, count=False), wide.match_prefix(p, count=False)
        assert [n.key for n in a] == [n.key for n in b]
        assert all(torch.equal(x.kv, y.kv) for x, y in zip(a, b, strict=True))
    with pytest.raises(OverflowError):  # an id no key can hold is refused, nothing widened
        RadixCache(block_size=2, capacity_tokens=8).match_prefix([1, -1])


def test_a_hybrid_models_prefix_serves_only_up_to_a_kept_state() -> None:
    """Linear attention keeps one state per request: a prefill resumes only where an earlier
    prompt ended (its last full block); KV matched past it is recomputed and counted."""
    a = list(range(1, 41))  # 2 full blocks of 16 (and 8 tokens more)
    for exact in (False, True):
        c = RadixCache(16, 1024, exact_states=exact)
        c.insert(a, _kv(40))
        assert len(c.match_prefix(a[:32] + [99] * 20)) == 2  # a prompt's end: its state is there
        shared_system_prompt = a[:16] + [77] * 30  # diverges after the first block of a
        assert len(c.match_prefix(shared_system_prompt)) == (0 if exact else 1)
        assert c.state_miss_tokens == (16 if exact else 0) and c.hit_tokens == (32 if exact else 48)
        c.insert(shared_system_prompt, _kv(46))  # its own state, at its last full block (32 tokens)
        assert len(c.match_prefix(shared_system_prompt[:32] + [5] * 16)) == 2
