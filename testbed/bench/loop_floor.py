"""The event loop's own cost of one simulated decode step, with none of the testbed's code in it.

A decode step in the simulator is at least: the paced step's timer, the ``call_soon`` that
flushes the step's token batch (``workers.runtime.Worker.stream``), the task that publishes
it, the broker hop's timer (``testbed.sim.bus``) and the client's queue and task waking.
This replays only that, on the simulator's loop (``testbed.sim.vloop``), and prices it: no
simulation that executes the workers' code step by step can cost less a step, whatever that
code does (``docs/simulation.md``, "Speed").
"""

from __future__ import annotations

import asyncio
import time

from testbed.sim.vloop import VirtualLoop

STEP_S = 0.02  # a decode step's modeled time (virtual: costs no host time)
HOP_S = 0.0002  # the broker hop


async def _steps(n: int) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[int] = asyncio.Queue()

    async def client() -> None:
        for _ in range(n):
            await inbox.get()

    async def publish(i: int) -> None:
        loop.call_later(HOP_S, inbox.put_nowait, i)

    def flush(i: int) -> None:
        asyncio.ensure_future(publish(i))

    reader = asyncio.ensure_future(client())
    for i in range(n):
        await asyncio.sleep(STEP_S)
        loop.call_soon(flush, i)
    await reader


def floor_us_per_step(steps: int = 200_000) -> float:
    """CPU microseconds one such step costs on this host."""
    loop = VirtualLoop()
    try:
        t0 = time.process_time()
        loop.run_until_complete(_steps(steps))
        return 1e6 * (time.process_time() - t0) / steps
    finally:
        loop.close()
