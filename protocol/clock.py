"""The clocks every component reads: the host's, or a simulation's virtual one.

Workers, the router, its policies and the replay client stamp events and measure durations
through this module (``clock.time()``, ``clock.monotonic()``, ``clock.perf_counter()``)
instead of ``time`` directly, so that the same code runs in both engines: in the emulation
these are the host's clocks; the simulator (``testbed/sim/``) installs its event loop's
virtual time, in which work costs no time and a wait jumps to its end. Timers are the
event loop's in either case (``asyncio.sleep`` and friends read ``loop.time()``).
"""

from __future__ import annotations

import contextlib
import time as _host
from collections.abc import Callable, Iterator

time: Callable[[], float] = _host.time  # seconds since the epoch (event stamps, records)
monotonic: Callable[[], float] = _host.monotonic  # intervals and deadlines
perf_counter: Callable[[], float] = _host.perf_counter  # the real work a step took


@contextlib.contextmanager
def installed(wall: Callable[[], float], mono: Callable[[], float]) -> Iterator[None]:
    """Every component reads ``wall`` and ``mono`` until the block ends (a simulation's
    virtual clocks; ``perf_counter`` reads ``mono``: work costs nothing it has not modeled)."""
    global time, monotonic, perf_counter
    saved = time, monotonic, perf_counter
    time, monotonic, perf_counter = wall, mono, mono
    try:
        yield
    finally:
        time, monotonic, perf_counter = saved
