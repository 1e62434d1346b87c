"""Token ids as the router holds them: 4-byte integers in one block (``array('i')``).

Parsed from a message, a prompt is a list of int objects: a 4K-token prompt took ~160 KB by
Python's count and, on the C allocator the router runs on, ~545 KB of resident memory (every
id its own 48-byte heap chunk, scattered among freed ones). The router keeps a window of
requests whose prompts grow as sessions' contexts do, so their lists grew its resident set by
megabytes; as arrays they take 16 KB per 4K tokens, and what they take is what they count.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TOKEN_BYTES = array("i").itemsize


def token_array(tokens: Sequence[int]) -> array[int]:
    """``tokens`` as an ``array('i')`` (the same object when it already is one)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
