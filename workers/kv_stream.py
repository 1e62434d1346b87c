"""KV streamed as it is computed (``kv_transfer: per-chunk``).

An engine that streams KV sends a chunk's KV as soon as the prefill pass that computed it
ends, so that the transfer overlaps the rest of the prefill; only the last chunk's KV is
left to cross once the prefill is done. Here the prefill's passes are known in advance (the
device model prices each one: ``Pacer.prefill_schedule``), so a transfer is handed the time
each part of its KV is computed, and a frame leaves only once all its tokens are. The same
``Computed`` is read by both transports (``kv_wire._send`` before each frame, the
simulator's sender before each burst), so the two engines stream alike.

The real small model computes the whole prompt in one call before any pacing: a frame due
before that call returned leaves when it returns (the compute's real time, which the
fidelity verdict already bounds by the modeled time).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence

from protocol import clock

# A due time counts as reached this close to it: a timer set for ``due - now`` wakes at a
# float that may fall an ulp short of ``due`` (the simulator's virtual clock does), and
# waiting again for that ulp would never advance.
DUE_EPS_S = 1e-9


class Computed:
    """When each part of a prompt's KV is computed, on ``clock.monotonic``: every pass known
    when the prefill starts (one request at a time, ``schedule``), or added as each pass ends
    (passes packing several requests: ``passed``)."""

    def __init__(self, start: float, hit: int, done: Sequence[int] = (), at: Sequence[float] = (),
                 final: bool = True) -> None:
        self.start = start  # the prefill's start
        self.hit = hit  # tokens the prefill had cached: their KV is there at once
        self.done = list(done)  # per pass: tokens after ``hit`` computed by its end (increasing)
        self.at = list(at)  # per pass: seconds from ``start`` to its end
        self.final = final  # every pass is known (False: ``passed`` adds them as they end)
        self._more = asyncio.Event()

    def passed(self, done: int, now: float) -> None:
        """A pass ended at ``now``: ``done`` tokens after ``hit`` are computed."""
        self.done.append(done)
        self.at.append(now - self.start)
        self._more.set()
        self._more = asyncio.Event()

    def due(self, tokens: int) -> float | None:
        """When the KV of the prompt's first ``tokens`` tokens is all computed (None: not
        known yet, a pass still to come)."""
        need = tokens - self.hit
        if need <= 0 or (not self.done and self.final):
            return self.start
        i = bisect.bisect_left(self.done, need)
        if i == len(self.done):
            return self.start + self.at[-1] if self.final else None
        return self.start + self.at[i]

    def ready(self, now: float) -> int:
        """Tokens (from the prompt's first) whose KV is computed at ``now``."""
        i = bisect.bisect_right(self.at, now - self.start + DUE_EPS_S)
        return self.hit + (self.done[i - 1] if i else 0)

    async def until(self, tokens: int, stops: Sequence[asyncio.Event] = ()) -> bool:
        """Wait until the first ``tokens`` tokens' KV is computed; False when one of ``stops``
        is set first."""
        while not any(ev.is_set() for ev in stops):
            due = self.due(tokens)
            wait = None if due is None else due - clock.monotonic()
            if wait is not None and wait <= DUE_EPS_S:
                break
            waits = [asyncio.ensure_future(ev.wait()) for ev in (*stops, self._more)]
            try:
                await asyncio.wait(waits, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return not any(ev.is_set() for ev in stops)


def schedule(start: float, hit: int, steps: list[tuple[int, float]]) -> Computed:
    """A ``Computed`` from ``Pacer.prefill_schedule``'s passes."""
    return Computed(start, hit, [d for d, _ in steps], [t for _, t in steps])
