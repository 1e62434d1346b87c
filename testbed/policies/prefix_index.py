"""What a decoder's prefix cache (probably) holds, as the router sees it.

The router cannot look into a main decoder's radix cache, so it keeps a shadow index of
the prompts it sent there: chained hashes of full token blocks, least-recently-used
eviction at the decoder's capacity. ``match(tokens)`` is the number of leading tokens the
decoder is expected to have; it errs only where the decoder's own eviction order differs
(the decoder never evicts blocks in use, the index does not know which are).

Held lean, as an index fills to its decoder's capacity (262,144 blocks at the report's
scale, thirteen of them in its deployment): a block is a 60-bit hash (an int below 2**60
is 32 bytes, above it 48) in a plain dict whose value is the insert that last used it; the
order of use is the inserts' own hash arrays (8 bytes a block), oldest first. Eviction
walks them from the front and drops a block only where its front entry is its last use,
which is the order an ordered dict with a move to the end per use evicts in, and so the
same blocks go. The arrays keep entries of blocks used again since; once they outnumber the
live blocks they are rewritten without them. An ordered dict of 16-byte digests took 154
bytes a block by Python's count (199 on the C allocator); this takes 97 (121). A 60-bit
collision (about one in 10^5 emulated hours of the report's load) would only make a match
a block too long: the index guides routing, it holds no KV.

With ``exact_states`` it shadows a hybrid model's prefill cache (``workers/radix_cache.py``):
a match ends at the last block where an inserted prompt ended, the only places a linear
layer's state is kept.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from array import array
from collections import deque
from collections.abc import Sequence

from protocol.policy import PolicyContext
from protocol.worker_config import PREFILL_ROLES
from testbed.policies.token_ids import TOKEN_BYTES, token_array

# Memory one indexed block costs with eviction going on (its dict entry and hash, its place
# in the order of use, entries not yet rewritten away included): the resident memory
# 100,000 entries of growing, prefix-sharing prompts took on the C allocator the router runs
# on (trimmed); Python's own count (tracemalloc) says 97. What ``nbytes`` reports.
ENTRY_BYTES = 121


class PrefixIndex:
    def __init__(self, block_size: int, capacity_tokens: int, exact_states: bool = False) -> None:
        self.block_size = block_size
        self.exact_states = exact_states
        self._states: set[int] = set()  # blocks an inserted prompt ended on (exact_states)
        self.capacity_blocks = capacity_tokens // block_size
        self._last: dict[int, int] = {}  # block hash -> the insert that last used it
        self._uses: deque[tuple[int, array[int]]] = deque()  # (insert, its hashes), oldest first
        self._front = 0  # entries of the oldest insert already evicted or passed
        self._listed = 0  # entries in ``_uses`` from ``_front`` on
        self._inserts = itertools.count()

    @classmethod
    def shadowing(cls, ctx: PolicyContext, role: str) -> PrefixIndex:
        """An index of what a worker of ``role`` caches, sized as the deployment's caches (a
        hybrid's prefill: matched only where a prompt ended)."""
        exact = role in PREFILL_ROLES and ctx.prefill_exact_states
        return cls(ctx.block_size, ctx.decode_cache_tokens, exact_states=exact)

    def _hashes(self, tokens: Sequence[int]) -> array[int]:
        # Over the ids as 4-byte integers, whatever sequence holds them: a list and the
        # router's arrays of the same prompt index alike.
        raw = token_array(tokens).tobytes()
        return _chained(raw, self.block_size * TOKEN_BYTES)

    def match(self, tokens: Sequence[int]) -> int:
        """Leading tokens the decoder probably holds. A look only: a policy compares every
        candidate's, and only the one that gets the prompt uses (and refreshes) its blocks,
        which ``insert`` records."""
        n = kept = 0
        last, states = self._last, self._states
        for h in self._hashes(tokens):
            if h not in last:
                break
            n += 1
            if h in states:
                kept = n
        return (kept if self.exact_states else n) * self.block_size

    def insert(self, tokens: Sequence[int]) -> None:
        hashes = self._hashes(tokens)
        if not hashes:
            return
        now = next(self._inserts)
        last = self._last
        for h in hashes:
            last[h] = now
        if self.exact_states:
            self._states.add(hashes[-1])
        self._uses.append((now, hashes))
        self._listed += len(hashes)
        while len(last) > self.capacity_blocks:
            self._evict_oldest()
        if self._listed > 2 * len(last) + 4096:
            self._rewrite()

    def _evict_oldest(self) -> None:
        last, uses = self._last, self._uses
        while True:
            when, hashes = uses[0]
            h = hashes[self._front]
            self._front += 1
            self._listed -= 1
            if self._front == len(hashes):
                uses.popleft()
                self._front = 0
            if last.get(h) == when:
                del last[h]
                self._states.discard(h)
                return

    def _rewrite(self) -> None:
        """The order of use without the entries of blocks used again since (or evicted)."""
        last, kept = self._last, deque()
        for i, (when, hashes) in enumerate(self._uses):
            live = array("q", (h for h in hashes[self._front if i == 0 else 0:] if last.get(h) == when))
            if live:
                kept.append((when, live))
        self._uses, self._front = kept, 0
        self._listed = sum(len(hs) for _, hs in kept)

    def __len__(self) -> int:
        return len(self._last)

    @property
    def nbytes(self) -> int:
        """About what the index holds in memory (it fills to its capacity like the cache it
        shadows)."""
        return len(self._last) * ENTRY_BYTES


@functools.lru_cache(maxsize=16)
def _chained(raw: bytes, step: int) -> array[int]:
    """Chained block hashes of ``raw`` (the low 60 bits of each block's 8-byte digest).
    Remembered for the last prompts: routing one request looks its prompt up in every
    candidate's index (a prefill per instance, a main decoder per instance, the policy's
    own), then inserts it; a 64K-token prompt is 4,096 hashes. The array returned is shared:
    never changed."""
    digests, h = [], b""
    for i in range(0, len(raw) - step + 1, step):
        h = hashlib.blake2b(h + raw[i : i + step], digest_size=8).digest()
        digests.append(h)
    cut = bytearray(b"".join(digests))
    cut[7::8] = cut[7::8].translate(_LOW_NIBBLE)  # each little-endian digest's top 4 bits cleared
    out = array("q")
    out.frombytes(cut)
    return out


_LOW_NIBBLE = bytes(b & 0x0F for b in range(256))
