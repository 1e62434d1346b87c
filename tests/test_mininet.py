"""The Mininet network backend (root): the same plan built from Mininet's nodes and links,
every Mininet step checked, Mininet's CLI on a live emulation, tokens exact on it.

``net check``, ``kill -9`` + ``testbed clean`` and ``testbed exec`` run on both backends in
``test_net.py`` and ``test_exec.py``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from testbed.errors import BuildError
from testbed.net import netns, runstate
from testbed.net.build import Network
from testbed.scenario import Scenario

from .conftest import ROOT, built, needs_root, scenario_with

pytestmark = needs_root


def _mininet(sc: Scenario) -> Scenario:
    return sc.model_copy(update={"network": sc.network.model_copy(update={"backend": "mininet"})})


def test_the_plan_is_built_from_mininet_nodes_in_the_runs_namespaces() -> None:
    with built(_mininet(scenario_with())) as net:
        from testbed.net.mininet_nodes import MininetNodes

        assert isinstance(net.nodes, MininetNodes)
        mn = net.nodes.net
        assert sorted(h.name for h in mn.hosts) == sorted(net.plan.hosts)
        assert sorted(s.name for s in mn.switches) == ["gw-a", "gw-b", "wan"]
        for name, h in net.plan.hosts.items():
            node = mn[name]
            assert netns.ns_inode(h.ns) is not None and node.IP() == h.ip
            assert netns.pids_in_namespace(h.ns) == [node.pid]  # the node's shell, in the run's namespace
            assert f"inet {h.ip}/24" in node.cmd("ip -o -4 addr show dev eth0")
        gw = mn["gw-a"]
        ports = gw.cmd("ls /sys/class/net/gw-a/brif").split()
        assert sorted(ports) == sorted(h.gw_port for h in net.plan.hosts.values() if h.dc == "a")
        assert "1 received" in mn["prefill"].cmd(f"ping -c 1 -W 2 {net.ip_of('decode-b')}")
        shells = [p.pid for p in net.run.processes if p.name.startswith("mininet ")]
        assert len(shells) == len(net.plan.namespaces)
    assert not any(netns.is_alive(pid, None) for pid in shells)


def test_an_error_mininet_only_logs_fails_the_build_naming_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mininet logs a failed command and carries on; the build must stop and undo."""
    from mininet.log import error
    from mininet.nodelib import LinuxBridge

    def start(self: LinuxBridge, _controllers: list[object]) -> None:
        error(f"brctl: cannot add bridge {self.name}\n")

    monkeypatch.setattr(LinuxBridge, "start", start)
    run = runstate.Run.new()
    with pytest.raises(BuildError, match=r"gateway .*gw-a.*Mininet: bridge gw-a: .*brctl: cannot add bridge gw-a"):
        Network.up(_mininet(scenario_with()), run)
    assert not [n for n in netns.list_namespaces() if n.startswith(run.prefix)]
    assert not any(netns.is_alive(p.pid, p.starttime) for p in run.processes)
    assert not run.dir.exists()


def test_mininet_cli_on_the_live_emulation() -> None:
    """``net up --cli``: the issue's commands in Mininet's CLI, then ``exit`` tears down."""
    script = "\n".join(["prefill ping -c 3 decode-b", "decode-b tc -s qdisc", "iperf prefill decode-b",
                        "pingall", "exit", ""])
    out = subprocess.run([sys.executable, "-m", "testbed", "net", "up", "--network", "mininet", "--cli"],
                         input=script, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr  # Mininet prints command output through its logger (stderr)
    run_id = re.search(r"run (\w+) is up", text)
    assert run_id is not None, text
    assert "3 packets transmitted, 3 received" in text
    rtt = re.search(r"rtt min/avg/max/mdev = ([\d.]+)/", text)  # min: the first ping also resolves ARP
    assert rtt is not None and 29 <= float(rtt.group(1)) <= 36, text  # 2 x 15 ms WAN delay
    assert "qdisc htb 1: dev eth0 root" in text  # decode-b's LAN shaping, seen from Mininet
    assert re.search(r"\*\*\* Results: \['[\d.]+ [MG]bits/sec', '[\d.]+ [MG]bits/sec'\]", text), text
    assert "Results: 0% dropped (30/30 received)" in text
    assert not [n for n in netns.list_namespaces() if n.startswith(f"pdd{run_id.group(1)}-")]


def test_cli_needs_the_mininet_backend() -> None:
    out = subprocess.run([sys.executable, "-m", "testbed", "net", "up", "--network", "pyroute2", "--cli"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "--network mininet" in out.stderr


def test_verify_on_mininet_is_exact_for_pdd() -> None:
    # PDD's requests take every path (prefill to relay in a, KV and commands across the WAN to
    # the main decoder in b); the other policies' tokens are checked on pyroute2's network
    # (tests/test_pipelines.py), which differs from Mininet's only below the sockets.
    out = subprocess.run([sys.executable, "-m", "testbed", "verify", "--network", "mininet", "--prompts", "4",
                          "--policies", "pdd"],
                         capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^pdd: 4 requests, .*identical to the reference$", out.stdout, re.M), out.stdout


def test_a_datacenter_name_too_long_for_mininets_port_names_is_refused() -> None:
    with pytest.raises(ValueError, match="datacenter 'longname'.*gw-longname-eth"):
        Scenario.model_validate({
            "name": "t", "network": {"backend": "mininet"},
            "datacenters": {"longname": {"hosts": {"c": {"role": "client"}}},
                            "b": {"hosts": {"d": {"role": "decode"}}}},
            "wan": {"between": ["longname", "b"], "forward": {"delay_ms": 1}, "reverse": {"delay_ms": 1}},
        })
