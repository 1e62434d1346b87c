"""Mininet topologies in (``--topo FILE.py:ClassName``): the shipped ``Topo`` is the default
scenario, and a topology that breaks a rule is refused naming the node or link (exit 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.scenario import load_scenario

from .conftest import ROOT, TOPOLOGIES

pytest.importorskip("mininet.topo", reason="make setup installs Mininet")
from testbed.net.topo_import import load_topo_scenario  # noqa: E402

BAD = textwrap.dedent('''
    from mininet.topo import Topo

    def two_dcs(t, wan=1, **host):
        a, b = t.addSwitch("s1", dc="a"), t.addSwitch("s2", dc="b")
        for name, role in [("client", "client"), ("router", "router"), ("prefill", "prefill")]:
            t.addLink(t.addHost(name, role=role), a)
        t.addLink(t.addHost("d", **({"role": "decode"} | host)), b)
        for _ in range(wan):
            t.addLink(a, b, bw=100, delay="5ms")
        return a, b

    class NoRole(Topo):
        def build(self):
            a, b = two_dcs(self)
            self.addLink(self.addHost("x"), b)

    class TwoWans(Topo):
        def build(self):
            two_dcs(self, wan=2)

    class NoWan(Topo):
        def build(self):
            two_dcs(self, wan=0)

    class HostOnTwoSwitches(Topo):
        def build(self):
            a, b = two_dcs(self)
            self.addLink("d", a)

    class BadDelay(Topo):
        def build(self):
            a, b = self.addSwitch("s1"), self.addSwitch("s2")
            for name, role in [("client", "client"), ("router", "router"), ("prefill", "prefill")]:
                self.addLink(self.addHost(name, role=role), a)
            self.addLink(self.addHost("d", role="decode"), b)
            self.addLink(a, b, delay="soon")

    class UnknownDevice(Topo):
        def build(self):
            two_dcs(self, device="tpu9")

    class Asymmetric(Topo):
        def build(self):
            a, b = two_dcs(self, wan=0)
            self.addLink(a, b, bw=100, delay="5ms", jitter="500us", loss=1, max_queue_size=100,
                         params2={"bw": 20, "delay": 2})
''')


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("topo") / "bad_topos.py"
    path.write_text(BAD)
    return path


def test_the_shipped_topo_is_the_default_scenario() -> None:
    base = load_scenario(TOPOLOGIES / "two-dc.yaml")
    sc = load_topo_scenario(f"{TOPOLOGIES / 'two_dc_topo.py'}:TwoDcTopo", base)
    assert sc.model_dump() == base.model_dump()


@pytest.mark.parametrize(("cls", "message"), [
    ("NoRole", "host 'x' has no role"),
    ("TwoWans", "exactly one switch-to-switch link .* found 2: s1-s2, s1-s2"),
    ("NoWan", "found 0: none"),
    ("HostOnTwoSwitches", "host 'd' is linked to 2 switches"),
    ("BadDelay", "link s1-s2: delay: expected a time"),
    ("UnknownDevice", "unknown device profile 'tpu9'"),
    ("Missing", "no Topo subclass 'Missing' \\(found: .*NoRole"),
])  # fmt: skip
def test_a_topology_that_breaks_a_rule_is_refused_naming_the_node_or_link(bad: Path, cls: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_topo_scenario(f"{bad}:{cls}", load_scenario(TOPOLOGIES / "two-dc.yaml"))


def test_link_parameters_per_direction(bad: Path) -> None:
    sc = load_topo_scenario(f"{bad}:Asymmetric", load_scenario(TOPOLOGIES / "two-dc.yaml"))
    fwd, rev = sc.wan.forward, sc.wan.reverse
    assert (fwd.rate_mbit, fwd.delay_ms, fwd.jitter_ms, fwd.loss_pct, fwd.queue_bytes) == (100, 5, 0.5, 1, 150_000)
    assert (rev.rate_mbit, rev.delay_ms, rev.jitter_ms) == (20, 2, 0.5)
    assert set(sc.datacenters["a"].hosts) == {"client", "router", "prefill"}


def test_the_cli_exits_2_naming_the_host_and_builds_nothing(bad: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "testbed", "net", "check", "--topo", f"{bad}:NoRole"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "host 'x' has no role" in res.stderr
    res = subprocess.run([sys.executable, "-m", "testbed", "net", "check", "--topo", "nope.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "expected FILE.py:ClassName" in res.stderr
