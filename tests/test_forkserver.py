"""The worker fork server: a forked worker runs in its host's namespace, writes its own log,
is reaped when it ends; a request it cannot serve is an error naming why."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from testbed.deploy.forkserver import ForkServer, launch_worker
from testbed.errors import BuildError
from testbed.net import netns

from .conftest import built, needs_root, small_wan


@needs_root
def test_a_forked_worker_runs_in_its_namespace_logs_and_is_reaped(tmp_path: Path) -> None:
    # The configuration is a FIFO: the worker blocks reading it until the test writes, which
    # leaves time to look at the process.
    cfg = tmp_path / "worker.cfg.json"
    os.mkfifo(cfg)
    log = tmp_path / "worker.log"
    with built(small_wan(1.0, None)) as net:
        ns = net.plan.hosts["hc"].ns
        pid = launch_worker(ns, cfg, log, "worker-test")
        assert pid != os.getpid()
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == netns.ns_inode(ns)
        assert os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "worker-test"
        assert os.getsid(pid) == pid  # its own session: a terminal's Ctrl-C goes to the orchestrator
        with open(cfg, "w") as f:
            f.write('{"role": "prefill"}')  # a WorkerConfig lacking nearly everything
        # The worker validates its configuration first: the error names the missing fields,
        # in the worker's own log, and the process ends (reaped by the server, no zombie).
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists()
        text = log.read_text()
        assert "validation error" in text and "WorkerConfig" in text, text


@needs_root
def test_a_namespace_that_does_not_exist_is_a_build_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="namespace pdd-no-such-ns does not exist"):
        launch_worker("pdd-no-such-ns", tmp_path / "c.json", tmp_path / "l.log", "worker-x")


def test_a_server_that_cannot_start_is_a_build_error_with_its_words(tmp_path: Path) -> None:
    server = ForkServer(module="testbed.no_such_module")
    with pytest.raises(BuildError, match=r"fork server .*\(status 1: .*No module named testbed.no_such_module"):
        server.launch("any", tmp_path / "c.json", tmp_path / "l.log", "worker-x")
    server.close()
