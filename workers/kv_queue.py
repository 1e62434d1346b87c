"""Per-receiver transfer queues at a KV sender.

A sender runs at most ``streams`` transfers to one receiver at once; the others wait their
turn in arrival order, the way a transfer engine queues work per peer. Why not one TCP
connection per transfer, all at once: on a line scaled down to tens of frames in flight
(``docs/emulated-time.md``), twenty parallel flows hold a frame or two each, lose them in
bursts and stall in retransmission timeouts, so which transfer finishes first changes from
run to run: noise the emulated line (thousands of frames in flight) would not have.

Guarantees: turns are granted in the order ``turn`` was called (asyncio's semaphore wakes
waiters first-in, first-out); a transfer cut off while it waits never takes a turn (its
``turn`` returns False and holds nothing); every True must be followed by ``release``.
"""

from __future__ import annotations

import asyncio


class PeerQueues:
    def __init__(self, streams: int = 1) -> None:
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self.streams = streams
        self._slots: dict[str, asyncio.Semaphore] = {}

    def _slot(self, peer: str) -> asyncio.Semaphore:
        return self._slots.setdefault(peer, asyncio.Semaphore(self.streams))

    async def turn(self, peer: str, cancel: asyncio.Event) -> bool:
        """Wait for a turn to send to ``peer``; False if ``cancel`` was set first."""
        if cancel.is_set():
            return False
        slot = self._slot(peer)
        acquire = asyncio.ensure_future(slot.acquire())
        cancelled = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({acquire, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
            if not acquire.done():
                acquire.cancel()
        got = acquire.done() and not acquire.cancelled()
        if got and cancel.is_set():
            slot.release()  # granted and cut off at the same moment: give the turn back
            return False
        return got

    def release(self, peer: str) -> None:
        self._slot(peer).release()

    def waiting(self, peer: str) -> int:
        """Transfers to ``peer`` waiting for a turn (not counting those running)."""
        slot = self._slots.get(peer)
        waiters = getattr(slot, "_waiters", None) if slot else None
        return len(waiters) if waiters else 0
