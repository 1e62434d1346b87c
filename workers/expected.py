"""The requests a decoder expects KV for, and those it no longer does.

A request's decode command (over the broker) and its KV's HELLO (straight from the prefill
over TCP) take different paths, so the HELLO may come first by a few milliseconds: the
receiver waits for the command a bounded time (``kv_hello_wait_s``), and refuses at once a
request that already ended here. A HELLO for a request never seen is refused after that
wait, and leaves nothing behind: a sender's slot to this decoder is never held for long.
"""

from __future__ import annotations

import asyncio
import contextlib

ENDED_KEPT = 4096  # ended request ids remembered (late HELLOs come within seconds)


class Expected:
    def __init__(self) -> None:
        self._known: dict[str, asyncio.Event] = {}
        self._ended: dict[str, None] = {}  # insertion-ordered, bounded

    def expect(self, rid: str) -> None:
        """The decode command of ``rid`` arrived."""
        self._known.setdefault(rid, asyncio.Event()).set()
        self._ended.pop(rid, None)

    def forget(self, rid: str) -> None:
        """``rid`` ended here: a HELLO for it from now on is refused at once."""
        self._known.pop(rid, None)
        self._ended[rid] = None
        while len(self._ended) > ENDED_KEPT:
            self._ended.pop(next(iter(self._ended)))

    def __contains__(self, rid: str) -> bool:
        return rid in self._known and self._known[rid].is_set()

    async def wait(self, rid: str, timeout_s: float) -> str | None:
        """None once ``rid``'s command is here (within ``timeout_s``), else why it is refused."""
        if rid in self._ended:
            return "it already ended here"
        ev = self._known.setdefault(rid, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout=timeout_s)
        if ev.is_set():
            return None
        if self._known.get(rid) is ev:
            del self._known[rid]  # a stranger's id is not kept
        return f"no command for it within {timeout_s:g} s"
