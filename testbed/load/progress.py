"""Progress of a long load on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """Progress of one replay on stderr: a live line on a terminal, a line every 15 s otherwise."""

    def __init__(self, label: str) -> None:
        self.label, self.tty, self.last = label, sys.stderr.isatty(), 0.0

    def __call__(self, n: int, total: int, failed: int) -> None:
        msg = f"  {self.label}: {n}/{total} requests finished ({failed} failed)"
        if self.tty:
            print("\r" + msg, end="", file=sys.stderr, flush=True)
        elif time.monotonic() - self.last >= 15 or n == total:
            self.last = time.monotonic()
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


