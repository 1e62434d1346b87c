"""How the replayer retries a failed request, as an agent's client library would.

A real agent does not give up on its session when one call fails: the OpenAI SDK retries a
failed request twice by default, after 0.5 s then 1 s (doubling, at most 8 s, each shortened
by up to a quarter at random). The replayer does the same, in emulated seconds: the caller
turns the backoff into real seconds with the dilation like every other time of the replay.

What is retried is what a client would see as a server or connection error (a worker that
died, a transfer that failed, a message the client could not read, a timeout, no worker to
plan on). What is not: a request the system can never serve (its KV exceeds a decoder's
capacity, the router refused it as malformed), and a router that is gone (nothing would
answer the retry).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Failures no retry can fix (as an HTTP client does not retry a 400): the request itself,
# or the router that would have to answer it.
PERMANENT = ("exceed", "router rejected", "rejected a command", "router down", "router stopped")


def retryable(reason: str) -> bool:
    return not any(marker in reason for marker in PERMANENT)


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more attempts after a failed one, the k-th (from 0) after
    ``min(initial_s * 2**k, max_s)`` emulated seconds, shortened by up to ``jitter``."""

    retries: int = 2
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if self.retries < 0 or self.initial_s < 0 or self.max_s < self.initial_s or not 0 <= self.jitter < 1:
            raise ValueError(f"retry policy out of range: {self}")

    def backoff_s(self, rid: str, k: int) -> float:
        """Emulated seconds before retry ``k`` of request ``rid`` (the same for the same pair:
        two runs of one trace wait alike)."""
        base = min(self.initial_s * 2**k, self.max_s)
        return base * (1 - self.jitter * random.Random(f"{rid}/{k}").random())


NO_RETRY = RetryPolicy(retries=0)
# The client's retries, as an agent's SDK retries, but waiting long enough that a request whose
# only worker of a role was killed (down up to 8 s, then started again) is sent to it once it is
# back: 1 + 2 + 4 + 8 s, at least 11 s with the jitter (two retries from 0.5 s spanned 1.5 s, and
# the default scenario's soak lost 5 % of its requests to its single prefill's restarts).
SOAK_RETRY = RetryPolicy(retries=4, initial_s=1.0)


def attempt_rid(rid: str, attempt: int) -> str:
    """The id the ``attempt``-th attempt (from 0) is sent under: every attempt is a request of
    its own to the router, so a late token of a failed one never mixes into the next."""
    return rid if attempt == 0 else f"{rid}@retry{attempt}"
