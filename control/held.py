"""What the router holds by design, left out of its memory floor (``workers.allocator``): its
prefix indexes (its own and its policy's) and the token arrays of the requests in flight or
just ended (a window of requests, whose prompts grow as a session's context does)."""

from __future__ import annotations

from collections.abc import Callable


class Held:
    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count

    @property
    def nbytes(self) -> int:
        return self.count()
