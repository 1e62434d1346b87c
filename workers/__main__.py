"""Entry point of a worker process: ``python -m workers CONFIG.json``.

The configuration is a ``WorkerConfig`` (``protocol/worker_config.py``), or a list of them
for a process that hosts several modeled instances; it is validated here before anything
else starts, and each worker's role picks its class.

Several instances in one process share its event loop and nothing else: each keeps its own
broker session (and last will), queue, batch, radix cache, pacer, statistics file and KV
sockets, opened inside its own host's namespace (``WorkerConfig.netns``) so that its KV
crosses its own links. A modeled step is a few hundred microseconds of Python, so one loop
serves many; a process per instance cost a Python interpreter, torch and an event loop's
wake-ups each.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from pathlib import Path

from pydantic import TypeAdapter

from protocol import clock
from protocol.worker_config import WorkerConfig
from workers.event_loop import new_event_loop
from workers.kinds import make_worker
from workers.namespace import use_socket_maker
from workers.privilege import Identity, NamespaceSockets, drop_privileges, no_new_privileges
from workers.runtime import Worker

GIL_SWITCH_S = 1e-4

_CONFIGS = TypeAdapter(WorkerConfig | list[WorkerConfig])


def load_configs(text: str) -> list[WorkerConfig]:
    """One configuration or a list; a list's workers must be modeled and each name its own
    namespace (a real forward pass needs the process's compute thread to itself)."""
    got = _CONFIGS.validate_json(text)
    cfgs = got if isinstance(got, list) else [got]
    if not cfgs:
        raise ValueError("no worker configuration")
    if len(cfgs) > 1:
        for c in cfgs:
            if c.compute != "modeled" or c.netns is None:
                raise ValueError(f"{c.name}: only modeled workers with a namespace share a process")
        if len({c.name for c in cfgs}) != len(cfgs):
            raise ValueError("two configurations name the same worker")
        if any(c.run_as != cfgs[0].run_as for c in cfgs):
            raise ValueError("the workers of one process run as one account")
    return cfgs


def set_up_privileges(cfgs: list[WorkerConfig]) -> Identity | None:
    """What the process needs once it is unprivileged: a process standing for several hosts
    gets its sockets in their namespaces from a root child (``NamespaceSockets``). Returns
    the account to become (None: stay as started)."""
    who = cfgs[0].run_as
    if who is None:
        return None
    namespaces = [c.netns for c in cfgs if c.netns is not None]
    if namespaces:
        use_socket_maker(NamespaceSockets(namespaces).tcp_socket)
    return Identity(who.uid, who.gid)


async def serve(workers: list[Worker]) -> str | None:
    """Run every worker until each has stopped; SIGTERM/SIGINT stop them all. Returns why
    the process must fail (a worker's task failed), or None."""
    if len(workers) == 1:
        await workers[0].main()
        return None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [w.stopping.set() for w in workers])

    async def run(w: Worker) -> str | None:
        try:
            await w.main(signals=False)
        except SystemExit as e:  # the worker's task failed: it said why, and it ends
            return str(e.code)
        finally:
            # An instance that ends takes the process down, and each sibling stops the way a
            # worker stops (its status says "dead"): a clean disconnect sends no last will,
            # so one left to be cancelled would stay "up" at the router with nobody behind.
            for other in workers:
                other.stopping.set()
        return None

    crashed = [why for why in await asyncio.gather(*(run(w) for w in workers)) if why]
    return "; ".join(crashed) or None


def main(config_path: str) -> None:
    no_new_privileges()  # before torch or anything else starts a thread
    cfgs = load_configs(Path(config_path).read_text())
    who = set_up_privileges(cfgs)  # before the model: its child is a copy of a small process
    workers: list[Worker] = [make_worker(c) for c in cfgs]
    clock.follow_steps(clock.steps_file(config_path), Path(config_path).name.removesuffix(".cfg.json"))
    # Root no longer: set up (configuration read, model loaded, statistics folder open),
    # the worker now takes what arrives from the broker and from KV peers.
    drop_privileges(who)
    # torch, transformers and the model (~340k objects) live as long as the process. Left to
    # the collector, every full pass scans them all (~160 ms here) at a moment nobody chose:
    # inside a paced step, that is an overrun. Frozen, a full pass scans only what came after.
    gc.collect()
    gc.freeze()
    # The forward pass runs on a compute thread and is mostly Python (module calls between
    # torch ops), so it needs the GIL back after every op. Whenever the event loop thread is
    # busy (a KV transfer's frames, a stats dump, a burst of token messages), CPython hands
    # the GIL over only every switch interval: at the default 5 ms a 12 ms prefill took
    # ~1 s beside a busy Python thread, at 0.1 ms ~48 ms (measured with this model).
    sys.setswitchinterval(GIL_SWITCH_S)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # timers that end paced steps on time
        crashed = runner.run(serve(workers))
    if crashed:
        raise SystemExit(crashed)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m workers CONFIG.json")
    main(sys.argv[1])
