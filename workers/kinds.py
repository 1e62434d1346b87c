"""The worker class of each role: the one place a role becomes code (the emulation's
processes, ``workers/__main__.py``, and the simulator's, ``testbed/sim/engine.py``)."""

from __future__ import annotations

from protocol.worker_config import WorkerConfig
from workers.colocated import ColocatedWorker
from workers.decode import DecodeWorker
from workers.prefill import PrefillWorker
from workers.runtime import Worker
from workers.transport import HOST, Transport

CLASSES: dict[str, type[Worker]] = {"prefill": PrefillWorker, "decode": DecodeWorker, "relay-decode": DecodeWorker,
                                    "colocated": ColocatedWorker}


def make_worker(cfg: WorkerConfig, transport: Transport = HOST) -> Worker:
    return CLASSES[cfg.role](cfg, transport)
