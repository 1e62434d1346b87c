"""A refusal, one line in the refusing process's log, within a budget: a peer that sends
nonsense thousands of times a second must not fill the logs' tmpfs (when it fills, every
component's next write fails). Up to ``BURST`` lines at once, ``PER_S`` a second after that;
past the budget a line is counted, and the next one printed says how many were left out."""

from __future__ import annotations

import sys
import time

BURST = 500
PER_S = 50.0
MAX_LINE = 2000  # characters of one line (a hostile payload echoed back is cut)


class _Budget:
    def __init__(self) -> None:
        self.tokens = float(BURST)
        self.last = time.monotonic()
        self.left_out = 0


_BUDGET = _Budget()


def refusal(line: str) -> None:
    b = _BUDGET
    now = time.monotonic()
    b.tokens = min(float(BURST), b.tokens + (now - b.last) * PER_S)
    b.last = now
    if b.tokens < 1:
        b.left_out += 1
        return
    b.tokens -= 1
    if b.left_out:
        print(f"({b.left_out} refusal line(s) left out: more than {PER_S:g} a second)", file=sys.stderr, flush=True)
        b.left_out = 0
    print(line[:MAX_LINE], file=sys.stderr, flush=True)
