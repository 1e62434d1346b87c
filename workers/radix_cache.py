"""Radix (prefix) cache of KV blocks, keyed by token blocks.

One concept, one module (after SGLang's RadixCache). The tree's edges are full blocks of
``block_size`` token IDs; each node holds the KV of its block, shape
``(layers, 2, kv_heads, block_size, head_dim)``. Guarantees:

* ``match_prefix(tokens)`` returns the longest cached prefix in whole blocks, and the KV
  returned for it is exactly what ``insert`` stored for those tokens (position-correct:
  a block's KV only exists under its own prefix);
* capacity is in tokens; when full, ``insert`` evicts least-recently-used *unlocked leaf*
  blocks first; a locked block (a request in flight uses it) and its ancestors are never
  evicted; if nothing evictable is left, the tail of the insert is dropped, not stored;
* eviction costs O(log n) per block: evictable leaves sit in a heap by last use, with
  stale entries (touched, locked or grown since) skipped when they surface and the heap
  rebuilt when they outnumber live blocks (a full 16K-block cache evicts and inserts a
  block in microseconds, where a walk of the tree per block took milliseconds);
* hit/miss counters (tokens) and evicted blocks are kept for reporting;
* with ``exact_states`` (a hybrid model's cache: ``testbed/hardware.py``), a match ends
  where a request's recurrent state was kept: at the last full block of a prompt (or of a
  prompt and its answer) that was inserted whole. Full-attention KV serves any prefix, a
  linear layer's state only the position it was taken at (Prefill-as-a-Service keeps the
  two apart the same way); KV matched beyond the last state is counted in
  ``state_miss_tokens``, not in the hits.

A block's key is its token ids as bytes, 2 per id while every id seen fits in 16 bits (the
testbed's vocabulary is 8,192) and 4 once one does not (every key is widened then, once):
made from a 64K-token prompt in a third of the time tuples of ints took, and hashed faster;
a 16-token block's key is 80 bytes as allocated instead of 112 with 4 per id. The keys of the last prompts looked up
are remembered (``_keys``): a prefill matches a prompt and inserts it, a decoder matches
what a transfer's HELLO names and inserts the same prompt once its KV has arrived.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)  # slots: a full cache of a 64K-token context's blocks is 4,096 of these each
class Node:
    key: bytes
    kv: torch.Tensor | None
    parent: Node | None  # None at the root and once evicted
    # Its children. Along a cached prompt nearly every node has one (the next block): that
    # node itself, and a dict by key once there are two or more. A dict on every node took
    # 224 of a block's ~409 bytes, and a full cache is 262,144 blocks at token scale 1; six
    # fields make a node 80 bytes (eight took 96).
    kids: Node | dict[bytes, Node] | None = None
    lock: int = 0
    last_used: int = 0
    state: bool = False  # a request's recurrent state is kept at this block's end (exact_states)

    @property
    def leaf(self) -> bool:
        return self.kids is None

    @property
    def alive(self) -> bool:
        """Not evicted (asked of a node a path held, never of the root)."""
        return self.parent is not None

    def child(self, key: bytes) -> Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is Node:
            return kids if kids.key == key else None
        return kids.get(key)  # type: ignore[union-attr]

    def add(self, child: Node) -> None:
        kids = self.kids
        if kids is None:
            self.kids = child
        elif type(kids) is Node:
            self.kids = {kids.key: kids, child.key: child}
        else:
            kids[child.key] = child  # type: ignore[index]

    def remove(self, child: Node) -> None:
        """Take ``child`` out of the tree (it is no longer alive)."""
        child.parent = None
        kids = self.kids
        if kids is child:
            self.kids = None
            return
        assert isinstance(kids, dict)
        del kids[child.key]
        if len(kids) == 1:
            (self.kids,) = kids.values()

    def children(self) -> list[Node]:
        kids = self.kids
        if kids is None:
            return []
        return [kids] if type(kids) is Node else list(kids.values())  # type: ignore[union-attr]


class RadixCache:
    def __init__(self, block_size: int, capacity_tokens: int, keeps_kv: bool = True,
                 exact_states: bool = False) -> None:
        """``keeps_kv`` False keeps the tree and no KV (a modeled worker's cache: its KV is
        zeros nobody reads; ``blocks_of`` then gives nothing); ``exact_states``: a prefix
        serves only up to a kept state (the module docstring)."""
        if block_size < 1 or capacity_tokens < 0:
            raise ValueError("block_size must be >= 1 and capacity >= 0")
        self.block_size = block_size
        self.keeps_kv = keeps_kv
        self.capacity_blocks = capacity_tokens // block_size
        self.root = Node(b"", None, None)
        self.blocks = 0
        self.nbytes = 0  # bytes the cache's own copies hold (views of modeled KV hold none)
        self._clock = itertools.count(1)
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.evicted_blocks = 0
        self.exact_states = exact_states
        self.state_miss_tokens = 0  # matched KV past the last kept state (exact_states): recomputed
        # (last_used when pushed, tie-break, node): candidates for eviction, possibly stale.
        self._leaves: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()
        self._memo: list[tuple[Sequence[int], list[bytes]]] = []  # the last prompts' keys
        self._id_code = "H"  # how an id is held in a key: "H" 2 bytes, "I" 4 once one needs it

    def _candidate(self, node: Node) -> None:
        """``node`` may now be an evictable leaf (new, touched, unlocked, or bare)."""
        if node is not self.root and node.leaf and node.lock == 0:
            heapq.heappush(self._leaves, (node.last_used, next(self._tie), node))
            if len(self._leaves) > 4 * self.blocks + 64:
                self._leaves = [(n.last_used, next(self._tie), n) for n in self._iter()
                                if n.leaf and n.lock == 0]
                heapq.heapify(self._leaves)

    def _keys(self, tokens: Sequence[int]) -> list[bytes]:
        for seen, keys in self._memo:
            if seen is tokens:
                return keys
        try:
            ids = array(self._id_code, tokens)
        except OverflowError:
            ids = array("I", tokens)  # an id beyond 16 bits (or one no key can hold: raised)
            self._widen()
        raw = ids.tobytes()
        step = self.block_size * ids.itemsize
        keys = [raw[i : i + step] for i in range(0, len(raw) - step + 1, step)]
        self._memo = [(tokens, keys), *self._memo[:1]]
        return keys

    def _widen(self) -> None:
        """Every key from 2 bytes an id to 4 (the first id beyond 16 bits has come)."""
        nodes = self._iter()
        for n in nodes:
            n.key = array("I", array("H", n.key)).tobytes()
        for n in (self.root, *nodes):
            if isinstance(n.kids, dict):
                n.kids = {c.key: c for c in n.kids.values()}
        self._id_code, self._memo = "I", []

    def match_prefix(self, tokens: list[int], count: bool = True) -> list[Node]:
        """Nodes of the longest cached block prefix of ``tokens`` (touching them as used)."""
        node, path = self.root, []
        now = next(self._clock)
        for key in self._keys(tokens):
            child = node.child(key)
            if child is None:
                break
            child.last_used = now
            path.append(child)
            node = child
        if path:
            self._candidate(path[-1])
        if self.exact_states:
            usable = self.resumable(path)
            if count:
                self.state_miss_tokens += (len(path) - len(usable)) * self.block_size
            path = usable
        if count:
            self.lookup_tokens += len(tokens)
            self.hit_tokens += len(path) * self.block_size
        return path

    def match_to_compute(self, tokens: list[int]) -> list[Node]:
        """The cached prefix a prefill resumes from: as ``match_prefix``, keeping at least one
        token to compute (its logits give the first output token)."""
        path = self.match_prefix(tokens)
        while path and len(path) * self.block_size >= len(tokens):
            path = self.resumable(path[:-1])
        return path

    def resumable(self, path: list[Node]) -> list[Node]:
        """``path`` up to its last kept state (``exact_states``), else all of it."""
        if not self.exact_states:
            return path
        return path[: next((i + 1 for i in range(len(path) - 1, -1, -1) if path[i].state), 0)]

    @staticmethod
    def kv_of(path: list[Node]) -> torch.Tensor | None:
        """The KV of a matched path as one tensor (a copy)."""
        return torch.cat(RadixCache.blocks_of(path), dim=3) if path else None

    @staticmethod
    def blocks_of(path: list[Node]) -> list[torch.Tensor]:
        """The KV blocks of a matched path, in order (views, no copy)."""
        return [n.kv for n in path if n.kv is not None]

    def lock(self, path: list[Node]) -> None:
        for n in path:
            n.lock += 1

    def unlock(self, path: list[Node]) -> None:
        for n in path:
            if n.lock <= 0:
                raise RuntimeError("unlock of an unlocked block")
            n.lock -= 1
        # Only the path's end can be a leaf (each node before it has the next as a child):
        # the one new candidate for eviction (a 64K-token path is 4,096 nodes).
        if path and path[-1].lock == 0:
            self._candidate(path[-1])

    def insert(self, tokens: list[int], kv: torch.Tensor, matched: list[Node] | None = None) -> int:
        """Store the KV (``kv[..., t, :]`` for token t) of every full block of ``tokens``.

        ``matched``: what ``match_prefix`` gave for these tokens, held (locked) since; the
        walk starts after it (a 64K-token prompt is 4,096 blocks, most of them a hit). Only
        leaves are evicted, so a path whose last node is alive is alive. Returns how many
        blocks are cached for this prefix afterwards.
        """
        bs = self.block_size
        node, first = self.root, 0
        if matched and matched[-1].alive:
            node, first = matched[-1], len(matched)
        now = next(self._clock)
        keys = self._keys(tokens)
        end = min(len(keys), kv.shape[3] // bs)  # blocks the KV covers
        depth = first
        for i in range(first, end):
            key = keys[i]
            child = node.child(key)
            if child is None:
                if self.blocks >= self.capacity_blocks and not self._evict_one(protect=node):
                    break
                block = kv[:, :, :, i * bs : (i + 1) * bs].clone() if self.keeps_kv else None
                child = Node(key, block, node)
                node.add(child)
                self.blocks += 1
                self.nbytes += block.nbytes if block is not None else 0
            child.last_used = now
            node = child
            depth += 1
        if node is not self.root:
            self._candidate(node)
            if self.exact_states and depth == len(keys):  # the whole prompt is in: its state is kept
                node.state = True
        return depth

    def evict(self, n_tokens: int) -> int:
        """Evict at least ``n_tokens`` worth of unlocked LRU leaf blocks; returns tokens freed."""
        freed = 0
        while freed < n_tokens and self._evict_one(protect=None):
            freed += self.block_size
        return freed

    def _evict_one(self, protect: Node | None) -> bool:
        """Evict the least recently used unlocked leaf, never ``protect`` (the node an insert
        is extending: its ancestors have children, so it is the only leaf to keep)."""
        kept = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            stamp, _, victim = entry
            if not victim.alive or not victim.leaf or victim.lock or stamp != victim.last_used:
                continue  # stale: re-pushed when it becomes a candidate again
            if victim is protect:
                kept = entry
                continue
            parent = victim.parent
            assert parent is not None
            parent.remove(victim)
            self.blocks -= 1
            self.nbytes -= victim.kv.nbytes if victim.kv is not None else 0
            self.evicted_blocks += 1
            self._candidate(parent)
            break
        else:
            victim = None
        if kept is not None:
            heapq.heappush(self._leaves, kept)
        return victim is not None

    def _iter(self) -> list[Node]:
        out, stack = [], self.root.children()
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children())
        return out

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
