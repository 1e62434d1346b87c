"""CPU and resident memory of every process of a run, read from ``/proc``.

CPU seconds go into the fidelity verdict (which process had the host); resident memory is
sampled on a thread while a load runs (a soak watches it for growth).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel

from testbed.deploy.fidelity import cpu_seconds

FLAT_SHARE = 0.10
FLAT_FLOOR_MB = 2.0


class ProcessMemory(BaseModel):
    name: str
    pid: int
    samples: int
    rss_first_mb: float  # first sample after the warm-up
    rss_peak_mb: float
    rss_last_mb: float
    settled_s: float = 0.0  # seconds between the first sample after the warm-up and the last
    rss_mid_mb: float | None = None  # halfway through those seconds
    # A worker's own floor (``workers.allocator``): the lowest RSS net of the KV it holds in the
    # first and in the second half of its settled life; None for other processes.
    floor_first_mb: float | None = None
    floor_second_mb: float | None = None

    @property
    def growth_mb(self) -> float:
        return self.rss_last_mb - self.rss_first_mb

    @property
    def judged_on_floor(self) -> bool:
        return self.floor_first_mb is not None and self.floor_second_mb is not None

    @property
    def late_growth_mb(self) -> float:
        """Growth over the second half of its settled life: of the floor net of KV for a
        worker that reports one, of RSS otherwise."""
        if self.floor_first_mb is not None and self.floor_second_mb is not None:
            return self.floor_second_mb - self.floor_first_mb
        return self.rss_last_mb - (self.rss_mid_mb if self.rss_mid_mb is not None else self.rss_first_mb)

    def flat(self, share: float = FLAT_SHARE) -> bool:
        """Grew by at most ``share`` over the second half of its settled life (or by less than
        ``FLAT_FLOOR_MB``, the page-granular noise of a process of a few MB). The first half
        is where bounded queues reach their depth (the delay line's) and where a decoder's
        radix cache fills: growth a leak keeps up and a full cache does not. A worker is
        judged on its floor (RSS net of the KV it holds, at each minute's lowest), which a
        cache still filling (a relay's, slowly) or the work in flight does not raise."""
        base = self.floor_first_mb if self.floor_first_mb is not None else (
            self.rss_mid_mb if self.rss_mid_mb is not None else self.rss_first_mb)
        return self.late_growth_mb <= max(share * base, FLAT_FLOOR_MB)


def with_floor(m: ProcessMemory, floor: list[tuple[float, int]], warmup_s: float = 60.0) -> ProcessMemory:
    """``m`` judged on a worker's floor series (minute start, bytes): the first minute left
    out (start-up), the rest split at its middle; unchanged with fewer than 4 minutes left."""
    if not floor:
        return m
    settled = [(t, b) for t, b in floor if t >= floor[0][0] + warmup_s]
    if len(settled) < 4:
        return m
    mid = (settled[0][0] + settled[-1][0]) / 2
    first = min(b for t, b in settled if t <= mid) / 2**20
    second = min(b for t, b in settled if t > mid) / 2**20
    return m.model_copy(update={"floor_first_mb": first, "floor_second_mb": second})


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_by_name(processes: list[tuple[str, int]]) -> dict[str, float]:
    """CPU seconds by process name: a restarted worker's processes (and Mininet's node
    shells, one name for all) add up."""
    cpu: dict[str, float] = {}
    for name, pid in processes:
        if (s := cpu_seconds(pid)) is not None:
            cpu[name] = cpu.get(name, 0.0) + s
    return cpu


class RssSampler:
    """Resident memory of every process ``processes()`` names (and this one: the client),
    every ``period_s``; samples before ``warmup_s`` only count towards the peak."""

    def __init__(self, processes: Callable[[], list[tuple[str, int]]], period_s: float = 2.0,
                 warmup_s: float = 60.0, floors: Callable[[], dict[int, list[tuple[float, int]]]] | None = None,
                 floors_every_s: float = 30.0) -> None:
        self.processes, self.period_s, self.warmup_s = processes, period_s, warmup_s
        self.series: list[tuple[float, str, int, float]] = []  # (t, name, pid, MB)
        # Processes that keep a memory floor (workers, the router): read every
        # ``floors_every_s``, the latest kept by pid, so one killed later keeps its own.
        self.floors_of, self.floors_every_s = floors, floors_every_s
        self.floors: dict[int, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> list[ProcessMemory]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._read_floors()
        by_proc: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for t, name, pid, mb in self.series:
            by_proc.setdefault((name, pid), []).append((t, mb))
        out = []
        for (name, pid), pts in sorted(by_proc.items()):
            settled = [(t, mb) for t, mb in pts if t >= self.warmup_s] or [pts[-1]]
            mid_t = (settled[0][0] + settled[-1][0]) / 2
            mid = next(mb for t, mb in settled if t >= mid_t)
            m = ProcessMemory(name=name, pid=pid, samples=len(pts), rss_first_mb=settled[0][1],
                              rss_peak_mb=max(mb for _, mb in pts), rss_last_mb=pts[-1][1],
                              settled_s=pts[-1][0] - settled[0][0], rss_mid_mb=mid)
            out.append(with_floor(m, self.floors.get(pid, [])))
        return out

    def _read_floors(self) -> None:
        if self.floors_of is None:
            return
        try:
            self.floors.update(self.floors_of())
        except (OSError, ValueError) as e:  # a file being replaced, or invalid: the next read
            print(f"memory floors: {e}", flush=True)

    def _run(self) -> None:
        next_floors = self.floors_every_s
        while not self._stop.wait(self.period_s):
            t = time.monotonic() - self.t0
            if t >= next_floors:
                self._read_floors()
                next_floors = t + self.floors_every_s
            for name, pid in [*self.processes(), ("orchestrator", os.getpid())]:
                mb = rss_mb(pid)
                if mb is not None:
                    self.series.append((t, name, pid, mb))
