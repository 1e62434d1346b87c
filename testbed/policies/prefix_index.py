"""What a decoder's prefix cache (probably) holds, as the router sees it.

The router cannot look into a main decoder's radix cache, so it keeps a shadow index of
the prompts it sent there: chained hashes of full token blocks, least-recently-used
eviction at the decoder's capacity. ``match(tokens)`` is the number of leading tokens the
decoder is expected to have; it errs only where the decoder's own eviction order differs
(the decoder never evicts blocks in use, the index does not know which are).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from testbed.policies.token_ids import TOKEN_BYTES, token_array

# Memory one indexed block costs (a 16-byte digest and its ordered-dict entry): the resident
# memory 100,000 entries with eviction took on the C allocator the router runs on (trimmed),
# 187 bytes; Python's own count (tracemalloc) says 155. What ``nbytes`` reports.
ENTRY_BYTES = 187


class PrefixIndex:
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def _hashes(self, tokens: Sequence[int]) -> list[bytes]:
        # Over the ids as 4-byte integers, whatever sequence holds them: a list and the
        # router's arrays of the same prompt index alike.
        raw = token_array(tokens).tobytes()
        return _chained(raw, self.block_size * TOKEN_BYTES)

    def match(self, tokens: Sequence[int]) -> int:
        """Leading tokens the decoder probably holds. A look only: a policy compares every
        candidate's, and only the one that gets the prompt uses (and refreshes) its blocks,
        which ``insert`` records."""
        n = 0
        blocks = self._blocks
        for h in self._hashes(tokens):
            if h not in blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, tokens: Sequence[int]) -> None:
        for h in self._hashes(tokens):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """About what the index holds in memory (it fills to its capacity like the cache it
        shadows)."""
        return len(self._blocks) * ENTRY_BYTES


@functools.lru_cache(maxsize=16)
def _chained(raw: bytes, step: int) -> list[bytes]:
    """Chained block hashes of ``raw``. Remembered for the last prompts: routing one request
    looks its prompt up in every candidate's index (a prefill per instance, a main decoder
    per instance, the policy's own), then inserts it; a 64K-token prompt is 4,096 hashes.
    The list returned is shared: never changed."""
    out, h = [], b""
    for i in range(0, len(raw) - step + 1, step):
        h = hashlib.blake2b(h + raw[i : i + step], digest_size=16).digest()
        out.append(h)
    return out
