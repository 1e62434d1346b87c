"""An asyncio event loop whose clock is virtual: it jumps to the next timer when every task waits.

The workers, the router, its policies and the replay client are asyncio programs that wait
on timers (a paced step, a timeout, a status period) and on each other (queues, events,
futures). On this loop nothing waits on the host: when no callback is ready, the clock
jumps to the earliest timer and the loop goes on, so an emulated hour passes as fast as the
Python that runs in it. The loop never does I/O: its selector (``_Clockwork``) has nothing
to poll, and asks for a timeout only to advance the clock by it. Real sockets, threads and
subprocesses would break virtual time, so the simulator gives every component a transport
of its own (``testbed/sim/bus.py``, ``testbed/sim/kv.py``) and no component makes one.

A loop with nothing ready and no timer would wait forever: ``Stalled`` is raised instead,
naming that nothing can happen any more (every request ends by a timer, so a simulation of
ours stalls only through a bug).
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

# Virtual time 0 on the wall clock the components stamp events with (``protocol.clock.now``):
# fixed, so two runs of the same inputs write the same numbers.
EPOCH = 1_800_000_000.0


class Stalled(RuntimeError):
    """Every task waits and no timer is set: nothing will ever happen again."""


class _Clockwork(selectors.BaseSelector):
    """A selector with no I/O: ``select(timeout)`` advances the virtual clock by ``timeout``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._map.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled("every task waits and no timer is set: the simulation cannot go on")
        if timeout > 0:
            self.now += timeout
        return []

    def get_map(self) -> dict[Any, selectors.SelectorKey]:  # type: ignore[override]
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual seconds since the loop was made; waiting takes no host time."""

    def __init__(self) -> None:
        self._clockwork = _Clockwork()
        super().__init__(self._clockwork)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._clockwork.now

    def wall(self) -> float:
        """Virtual time on the wall clock (``EPOCH`` + ``time()``): what events are stamped with."""
        return EPOCH + self._clockwork.now
