"""A worker process's memory: freed memory given back, and what it holds beyond its KV.

A worker allocates and frees KV all the time (a request's KV arrives, is decoded on, is
cached or dropped; cache blocks are evicted). glibc's malloc keeps freed memory inside its
heaps: a burst of requests in flight (the backlog after a WAN outage) would leave RSS at the
burst's high-water mark, in steps, long after the memory was freed. ``malloc_trim(0)``
hands free pages in every arena back (``madvise``), at a cost of milliseconds; the process
trims every ``TRIM_PERIOD_S`` on a worker's compute thread, between steps, and counts what
it gave back.

What remains still moves with the KV in flight (every sequence's buffer, the decode batch)
and with the prefix caches, which fill to their configured size over minutes (a relay caches
only what it relays: slowly). Neither is a leak, and RSS alone cannot tell them from one. So
the process also keeps, per minute, the lowest RSS net of the KV its holders (caches and
workers, each saying its ``nbytes``) hold, sampled each status period: the *floor*. A leak
raises the floor; a cache filling or a burst of requests does not. ``testbed soak`` judges
workers on it.

A buffer allocated for a request's whole length (prompt and every output token) is resident
only where it was written: holders count the pages of their buffers that are resident
(``resident_bytes``, the kernel's ``mincore``), not their size, which overcounted a busy
decoder's buffers by gigabytes and drove its floor below zero.

On a C library without ``malloc_trim`` (musl) nothing is trimmed and the counters stay 0.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Protocol

from protocol.worker_config import MemoryReport

TRIM_PERIOD_S = 10.0  # real seconds between trims
FLOOR_BUCKET_S = 60
MAX_FLOOR_POINTS = 1440  # a day of minutes; later minutes fold into the last one
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_trim = getattr(_libc, "malloc_trim", None)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


class _Holder(Protocol):
    """A cache, or a worker, saying how many bytes of KV it holds."""

    @property
    def nbytes(self) -> int: ...


def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of the pages in ``[addr, addr + length)`` that are in memory (a page the range
    shares with a neighbour counts whole)."""
    if length <= 0:
        return 0
    start = addr - addr % _PAGE
    pages = (addr + length - start + _PAGE - 1) // _PAGE
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(start, pages * _PAGE, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return vec.raw.count(1) * _PAGE  # bit 0: resident; the kernel sets no other bit


class MemoryWatch:
    """One per process (several modeled instances may share it): trims, and the floor."""

    def __init__(self) -> None:
        # Off in a simulation (``testbed/sim/``): its processes are not the emulated system's,
        # and a trim runs on a thread, which virtual time cannot wait for.
        self.enabled = True
        self.holders: dict[int, _Holder] = {}
        self.trims = 0
        self.trim_s = 0.0
        self.released = 0  # bytes of RSS given back, summed over trims
        self.floor: list[tuple[float, int]] = []  # (minute's start on the monotonic clock, lowest RSS - KV held)
        self._last_trim = time.monotonic()

    def add_holder(self, holder: _Holder) -> None:
        if self.enabled:
            self.holders[id(holder)] = holder

    def held_bytes(self) -> int:
        return sum(h.nbytes for h in self.holders.values())

    def sample(self) -> None:
        if not self.enabled:
            return
        net = rss_bytes() - self.held_bytes()
        # Monotonic: a step of the wall clock would disorder the series.
        minute = float(int(time.monotonic()) // FLOOR_BUCKET_S * FLOOR_BUCKET_S)
        if self.floor and (self.floor[-1][0] == minute or len(self.floor) >= MAX_FLOOR_POINTS):
            self.floor[-1] = (self.floor[-1][0], min(self.floor[-1][1], net))
        else:
            self.floor.append((minute, net))

    def trim_due(self) -> bool:
        """True once per ``TRIM_PERIOD_S`` (whichever instance of the process asks first)."""
        now = time.monotonic()
        if not self.enabled or now - self._last_trim < TRIM_PERIOD_S:
            return False
        self._last_trim = now
        return True

    def trim(self) -> None:
        if _trim is None:
            return
        before, t0 = rss_bytes(), time.perf_counter()
        _trim(0)
        self.trim_s += time.perf_counter() - t0
        self.released += max(0, before - rss_bytes())
        self.trims += 1

    def report(self) -> MemoryReport:
        return MemoryReport(pid=os.getpid(), rss_bytes=rss_bytes(), held_bytes=self.held_bytes(),
                            trims=self.trims, trim_s=round(self.trim_s, 6), released_bytes=self.released,
                            floor=list(self.floor))


WATCH = MemoryWatch()
