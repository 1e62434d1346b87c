"""Freed memory goes back to the system, so a worker's RSS follows what it holds.

A worker allocates and frees KV all the time (a request's KV arrives, is decoded on, is
cached or dropped; cache blocks are evicted). glibc's malloc keeps freed memory inside its
heaps: a burst of requests in flight (the backlog after a WAN outage) leaves RSS at the
burst's high-water mark, in steps, long after the memory was freed, and a 30-minute soak
cannot tell that from a leak. ``malloc_trim(0)`` hands free pages in every arena back
(``madvise``), at a cost of milliseconds; each worker calls it every ``TRIM_PERIOD_S`` on
its compute thread, where it never races a step, and counts what it gave back.

On a C library without ``malloc_trim`` (musl) nothing is trimmed and the counters stay 0.
"""

from __future__ import annotations

import ctypes
import os
import time

TRIM_PERIOD_S = 10.0  # real seconds between trims
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None)
_trim = getattr(_libc, "malloc_trim", None)


def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Trimmer:
    """Trims, and counts: how often, how long it took, how much resident memory it released."""

    def __init__(self) -> None:
        self.trims = 0
        self.seconds = 0.0
        self.released = 0  # bytes of RSS given back, summed over trims

    def __call__(self) -> None:
        if _trim is None:
            return
        before, t0 = rss_bytes(), time.perf_counter()
        _trim(0)
        self.seconds += time.perf_counter() - t0
        self.released += max(0, before - rss_bytes())
        self.trims += 1
