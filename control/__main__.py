"""The router process: ``python -m control CONFIG.json`` inside the router host's namespace."""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

from control.router import Router
from protocol import clock
from protocol.router_config import RouterConfig
from testbed.policies import policy_class
from workers.privilege import Identity, drop_privileges, no_new_privileges

if __name__ == "__main__":
    no_new_privileges()  # before anything starts a thread
    cfg = RouterConfig.model_validate_json(Path(sys.argv[1]).read_text())
    router = Router(cfg)
    clock.follow_steps(clock.steps_file(sys.argv[1]), "router")  # a clock-step fault's
    policy_class(cfg.policy)  # a plugin's file, checked and imported while root; run after root is dropped
    # What arrives from the broker is parsed without root (the configuration, read above,
    # holds the broker credential and stays root's).
    drop_privileges(Identity(cfg.run_as.uid, cfg.run_as.gid) if cfg.run_as else None)
    gc.collect()
    gc.freeze()  # no full collector pass over the imports at a moment routing should happen
    asyncio.run(router.main())
