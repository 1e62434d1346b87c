"""Entry point of a worker process: ``python -m workers CONFIG.json``."""

import sys

from workers.runtime import run_worker

if len(sys.argv) != 2:
    raise SystemExit("usage: python -m workers CONFIG.json")
run_worker(sys.argv[1])
