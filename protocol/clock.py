"""The clocks every component reads: the host's, or a simulation's virtual one.

Workers, the router, its policies and the replay client stamp events and measure durations
through this module instead of ``time`` directly, so that the same code runs in both
engines: in the emulation these are the host's clocks; the simulator (``testbed/sim/``)
installs its event loop's virtual time, in which work costs no time and a wait jumps to its
end. Timers are the event loop's in either case (``asyncio.sleep`` and friends read
``loop.time()``).

- ``now()``: event stamps, compared across processes (a token's arrival at the client with
  the KV's at a decoder). The host's ``CLOCK_MONOTONIC``, one clock for every process on the
  host (namespaces do not change it) that no wall-clock step moves; the simulator's
  ``EPOCH`` + virtual seconds.
- ``monotonic()``: intervals and deadlines inside one process.
- ``perf_counter()``: the real work a step took.
- ``wall()``: seconds since the epoch as this component's own wall clock says, for what a
  person reads as a date (an API's ``created``), never for a duration. A ``clock-step`` fault
  moves it (``follow_steps``; the simulator's ``Skew`` of each component), and only it:
  nothing measured may change when it does.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import signal
import sys
import time as _host
from collections.abc import Callable, Iterator
from pathlib import Path

now: Callable[[], float] = _host.monotonic
monotonic: Callable[[], float] = _host.monotonic
perf_counter: Callable[[], float] = _host.perf_counter
_wall: Callable[[], float] = _host.time


class Skew:
    """How far a component's wall clock was stepped from the host's (seconds)."""

    def __init__(self) -> None:
        self.s = 0.0


# A process is one component in the emulation (the default, process-wide skew); in the
# simulator each component's tasks run in a context holding its own (``own_wall_clock``).
_PROCESS = Skew()
_skew: contextvars.ContextVar[Skew] = contextvars.ContextVar("wall_clock_skew", default=_PROCESS)
MAX_STEP_S = 10 * 365 * 86400.0  # a step beyond ten years is a lie, not a clock


def wall() -> float:
    return _wall() + _skew.get().s


def steps_file(config_path: str | Path) -> Path:
    """Where root writes a component's wall-clock skew: beside its configuration
    (``router.cfg.json`` -> ``router.clock.json``), in the run's root-owned folder."""
    p = Path(config_path)
    return p.with_name(p.name.removesuffix(".json").removesuffix(".cfg") + ".clock.json")


def read_skew(path: Path) -> float:
    """The skew in ``path`` (``{"skew_s": S}``, root's, a few bytes): read without following
    a link, checked as any input is; ValueError or OSError says what is wrong."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = os.read(fd, 257)
    finally:
        os.close(fd)
    if len(data) > 256:
        raise ValueError(f"{path}: over 256 bytes")
    doc = json.loads(data)
    s = doc.get("skew_s") if isinstance(doc, dict) else None
    if type(s) not in (int, float) or not math.isfinite(s) or abs(s) > MAX_STEP_S:
        raise ValueError(f"{path}: skew_s: expected seconds within +-{MAX_STEP_S:g}, got {s!r}")
    return float(s)


def follow_steps(path: Path, who: str) -> None:
    """This process is one component (the emulation): on SIGUSR2 its wall clock takes the
    skew root wrote at ``path`` (a ``clock-step`` fault), said in one line; a file that
    cannot be read is said and changes nothing."""

    def on_signal(_sig: int, _frame: object) -> None:
        try:
            _PROCESS.s = read_skew(path)
        except (OSError, ValueError) as e:
            print(f"{who}: a clock step was signalled, but: {e}", file=sys.stderr, flush=True)
            return
        print(f"{who}: wall clock stepped: {_PROCESS.s:+g} s from the host's, now "
              f"{_host.strftime('%Y-%m-%d %H:%M:%S', _host.gmtime(wall()))} UTC", file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR2, on_signal)
    if path.exists():  # started again on a component whose clock was stepped before
        on_signal(signal.SIGUSR2, None)


def own_wall_clock() -> Skew:
    """Give the current context (a simulated component's first task, and every task it
    starts) a wall clock of its own, not yet stepped."""
    skew = Skew()
    _skew.set(skew)
    return skew


@contextlib.contextmanager
def installed(stamps: Callable[[], float], mono: Callable[[], float]) -> Iterator[None]:
    """Every component reads ``stamps`` for ``now`` and the wall clock, and ``mono`` for
    intervals, until the block ends (a simulation's virtual clocks; ``perf_counter`` reads
    ``mono``: work costs nothing it has not modeled)."""
    global now, monotonic, perf_counter, _wall
    saved = now, monotonic, perf_counter, _wall
    now, monotonic, perf_counter, _wall = stamps, mono, mono, stamps
    try:
        yield
    finally:
        now, monotonic, perf_counter, _wall = saved
