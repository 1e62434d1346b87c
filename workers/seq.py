"""A request's state on a decode worker (``Seq``) and its part in a PDD handoff.

``Seq`` owns the request's KV buffer, preallocated for prompt + output so that appending
a token's KV writes in place. ``append`` is the one way KV and tokens are added (a decode
step, an extend-decode of eager tokens), so the buffer, its fill level and the output
always agree. With modeled compute (``zeros`` set) there is no buffer: the KV is all zeros
and only its length is kept, so loading a prompt or appending a token copies nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol.messages import HandoffCmd
from workers.radix_cache import Node


@dataclass
class RelayState:
    """This worker relays the request (PDD's RLD) and hands over to ``main``."""

    main: str
    eager_budget: int | None = None
    ready: HandoffCmd | None = None  # how to hand over, once the MD holds the KV
    handed: int = 0  # eager tokens handed over so far
    awaiting_ack: bool = False
    batches: list[int] = field(default_factory=list)
    last_pending: int | None = None  # pending tokens when the last catch-up batch was sent


@dataclass
class MainState:
    """This worker takes the request over from ``relay`` (PDD's MD)."""

    relay: str
    pred: int = 0  # greedy token after everything extended so far
    extended: int = 0
    claimed: int = 0  # eager tokens taken by an extend, in progress or done (>= extended)
    final_claimed: bool = False  # the final extend has been taken
    final: bool = False
    mismatches: int = 0


@dataclass(eq=False)
class Seq:
    rid: str
    prompt: list[int]
    max_new: int
    registered: float
    buf: torch.Tensor | None = None
    zeros: Callable[[int], torch.Tensor] | None = None  # modeled: KV of n tokens, never stored
    n: int = 0  # tokens whose KV is in ``buf``
    out: list[int] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)  # locked radix-cache prefix while KV arrives
    kv_arrived: float = 0.0
    kv_bytes: int = 0
    ticket: str = ""  # the router's: this request's KV is taken only from a sender that has it
    drc: bool = True  # use and fill this worker's radix cache
    ignore_eos: bool = False  # run to ``max_new`` past the end-of-sequence token
    streamed: int = 0  # tokens this worker has streamed to the client
    paused: bool = False  # left out of decode steps (a relay holding at its eager budget)
    cache_only: bool = False  # KV still welcome for the radix cache, nothing to decode
    relay: RelayState | None = None
    main: MainState | None = None
    kv_deadline: asyncio.Task[None] | None = None  # fails the request if its KV does not arrive

    def stop_kv_deadline(self) -> None:
        if self.kv_deadline is not None:
            self.kv_deadline.cancel()
            self.kv_deadline = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def kv(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros(self.n)
        assert self.buf is not None
        return self.buf[:, :, :, : self.n]

    def load(self, kv: torch.Tensor) -> None:
        """Take the prompt's KV ``(layers, 2, kv_heads, tokens, head_dim)`` into a buffer with
        room for every output token."""
        s = kv.shape
        if self.zeros is not None:
            self.n = s[3]
            return
        self.buf = torch.empty((s[0], s[1], s[2], s[3] + self.max_new, s[4]), dtype=kv.dtype)
        self.buf[:, :, :, : s[3]] = kv
        self.n = s[3]

    def append(self, kv: torch.Tensor, tokens: list[int]) -> None:
        """Append ``k`` columns of KV and ``k`` output tokens: a decode step adds the KV of the
        token it fed and the token it produced; an extend adds eager tokens and their KV."""
        k = kv.shape[3]
        assert k == len(tokens)
        if self.zeros is None:
            assert self.buf is not None and self.n + k <= self.buf.shape[3]
            self.buf[:, :, :, self.n : self.n + k] = kv
        self.n += k
        self.out.extend(tokens)
