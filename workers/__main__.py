"""Entry point of a worker process: ``python -m workers CONFIG.json``.

The configuration is a ``WorkerConfig`` (``workers/contracts.py``), validated here before
anything else starts; its role picks the worker class.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from workers.contracts import WorkerConfig
from workers.decode import DecodeWorker
from workers.prefill import PrefillWorker
from workers.runtime import Worker


def main(config_path: str) -> None:
    cfg = WorkerConfig.model_validate_json(Path(config_path).read_text())
    worker: Worker = PrefillWorker(cfg) if cfg.role == "prefill" else DecodeWorker(cfg)
    asyncio.run(worker.main())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m workers CONFIG.json")
    main(sys.argv[1])
