"""Entry point of a worker process: ``python -m workers CONFIG.json``.

The configuration is a ``WorkerConfig`` (``protocol/worker_config.py``), validated here before
anything else starts; its role picks the worker class.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

from protocol.worker_config import WorkerConfig
from workers.decode import DecodeWorker
from workers.event_loop import new_event_loop
from workers.prefill import PrefillWorker
from workers.runtime import Worker

GIL_SWITCH_S = 1e-4


def main(config_path: str) -> None:
    cfg = WorkerConfig.model_validate_json(Path(config_path).read_text())
    worker: Worker = PrefillWorker(cfg) if cfg.role == "prefill" else DecodeWorker(cfg)
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
        runner.run(worker.main())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m workers CONFIG.json")
    main(sys.argv[1])
