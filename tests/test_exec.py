"""``testbed exec HOST -- CMD``: a command inside a host of a running emulation, its exit
status passed through; clear errors when there is no such run or host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from testbed.net import runstate
from testbed.net.plan import make_plan
from testbed.scenario import load_scenario

from .conftest import ROOT, TOPOLOGIES
from .test_net import _start_net_up

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


def _exec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed", "exec", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("network", ["pyroute2", "mininet"])
def test_exec_runs_in_the_hosts_namespace_and_passes_the_exit_status(network: str) -> None:
    proc, run_id = _start_net_up(TOPOLOGIES / "two-dc.yaml", "--network", network)
    try:
        plan = make_plan(load_scenario(TOPOLOGIES / "two-dc.yaml"), f"pdd{run_id}")
        for host in ("decode-b", "client"):  # each in its own namespace, with its own address
            out = _exec("--run", run_id, host, "--", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
            assert out.returncode == 0, out.stderr
            assert f" {plan.hosts[host].ip}/24 " in out.stdout
        assert _exec("--run", run_id, "wan", "--", "sh", "-c", "exit 7").returncode == 7
        missing = _exec("--run", run_id, "decode-b", "--", "no-such-command-here")
        assert missing.returncode == 127 and "no-such-command-here" in missing.stderr
        unknown = _exec("--run", run_id, "nope", "--", "true")
        assert unknown.returncode == 2 and "no host 'nope'" in unknown.stderr and "decode-b" in unknown.stderr
        assert _exec("--run", run_id, "decode-b").returncode == 2  # no command
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        runstate.destroy(run_id, [], [])
    gone = _exec("--run", run_id, "decode-b", "--", "true")
    assert gone.returncode == 2 and f"no live run {run_id}" in gone.stderr
