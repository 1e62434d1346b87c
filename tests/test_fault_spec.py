"""Fault timelines without a network: parsing, validation against a scenario, the injector's
schedule and how faults on one direction combine (a recording stand-in for the network)."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testbed.deploy.fault_injection import FaultInjector, annotate_failures
from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault, parse_fault
from testbed.net import netns
from testbed.net.delayline_contract import DirectionOverride

from .conftest import ROOT, TOPOLOGIES, run_cli_output, scenario_with


@pytest.mark.parametrize("text", ["wan-down@20+5", "loss@30+10:pct=5", "kill@40:host=decode-b",
                                  "delay@1.5+2:dir=a->b,ms=200", "rate@2+3:mbit=100", "partition@3+4:dc=b",
                                  "kill@4+3:host=relay",
                                  "broker-restart@5+2", "broker-restart@5"])
def test_a_spec_reads_back_as_written(text: str) -> None:
    assert parse_fault(text).label == text


@pytest.mark.parametrize(("text", "says"), [
    ("loss@30", "loss needs pct"),
    ("foo@3", "kind: Input should be 'wan-down'"),
    ("wan-down@soon", "START: expected seconds, got 'soon'"),
    ("loss@3:pct=200", "pct: Input should be less than or equal to 100"),
    ("wan-down@3:pct=2", "wan-down takes no pct"),
    ("wan-down@3:dir=a<-b", "dir must be both or SRC->DST"),
    ("delay@3:ms=5,color=red", "color: Extra inputs are not permitted"),
    ("wan-down@-1", "at_s: Input should be greater than or equal to 0"),
    ("wan-down@1+0", "duration_s: Input should be greater than 0"),
    ("wan-down", "expected KIND@START[+DURATION]"),
])
def test_bad_specs_name_the_field(text: str, says: str) -> None:
    with pytest.raises(InputError) as e:
        parse_fault(text)
    assert f"--fault {text!r}: " in str(e.value) and says in str(e.value), str(e.value)


def test_scenario_faults_are_checked_against_its_names() -> None:
    sc = scenario_with({"faults": ["wan-down@1+2", {"kind": "kill", "at_s": 3, "host": "relay"}]})
    assert [f.label for f in sc.faults] == ["wan-down@1+2", "kill@3:host=relay"]
    for fault, says in [("kill@1:host=router", "host 'router' runs no worker"),
                        ("partition@1:dc=c", "dc 'c': the datacenters are a and b"),
                        ("loss@1:pct=3,dir=a->c", "dir 'a->c': the datacenters are a and b"),
                        ("loss@1", "loss needs pct")]:
        with pytest.raises(InputError) as e:
            scenario_with({"faults": [fault]})
        assert "faults" in str(e.value) and says in str(e.value), str(e.value)
    unshaped = {"wan": {"forward": {"rate_mbit": None}}}
    with pytest.raises(InputError, match=r"WAN a->b has no rate to drop"):
        scenario_with({**unshaped, "faults": ["rate@1:mbit=10"]})
    scenario_with({**unshaped, "faults": ["rate@1:mbit=10,dir=b->a"]})  # the shaped direction is fine


def test_a_bad_fault_on_the_command_line_exits_2_before_anything_is_built(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked with the other inputs, before either engine builds anything (the simulator's
    # path here: no fork server to start for a command that fails).
    code, _, err = run_cli_output(["run", "--engine", "sim", "--scenario", str(TOPOLOGIES / "two-dc.yaml"),
                                   "--trace", str(ROOT / "traces" / "agentic-quick.jsonl"),
                                   "--fault", "kill@3:host=nobody"], capsys)
    assert code == 2
    assert "--fault 'kill@3:host=nobody': host 'nobody' runs no worker" in err


@dataclass
class _Plan:
    wan_between: tuple[str, str] = ("a", "b")
    wan_shaping: dict[tuple[str, str], Any] = field(default_factory=lambda: {("a", "b"): None, ("b", "a"): None})


@dataclass
class _Proc:
    pid: int
    name: str
    starttime: int | None


@dataclass
class FakeNetwork:
    """Records what the injector asks of the network backend."""

    plan: _Plan = field(default_factory=_Plan)
    calls: list[tuple[float, str, Any]] = field(default_factory=list)
    processes: list[_Proc] = field(default_factory=list)

    @property
    def run(self) -> FakeNetwork:
        return self

    def impair_wan(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        self.calls.append((time.monotonic(), "impair", dict(overrides)))

    def set_wan_rate(self, src: str, dst: str, rate_bps: int | None) -> None:
        self.calls.append((time.monotonic(), "rate", (src, dst, rate_bps)))


def test_injector_applies_and_clears_on_schedule_and_combines_faults() -> None:
    net = FakeNetwork()
    d = 0.2  # real seconds per emulated second: the whole timeline takes 0.8 s
    faults = [parse_fault(t) for t in ["wan-down@1+2:dir=a->b", "loss@2+2:pct=5", "delay@1+1:ms=20,dir=b->a",
                                       "rate@4:mbit=100,dir=a->b"]]
    inj = FaultInjector(net, faults, dilation=d, wire_rate_bps=lambda bps: bps / 1000)  # type: ignore[arg-type]
    t0 = time.monotonic()
    inj.start(t0)
    time.sleep(6 * d)
    log = inj.stop()
    states = [(round((t - t0) / d, 1), kind, arg) for t, kind, arg in net.calls]
    ab, ba = ("a", "b"), ("b", "a")
    down_ab = DirectionOverride(down=True)
    slow_ba = DirectionOverride(extra_delay_ms=20 * d)  # wire delay = emulated x dilation
    expected = [
        {ab: down_ab},  # t=1: wan-down a->b ...
        {ab: down_ab, ba: slow_ba},  # ... and delay b->a (both due at t=1, in spec order)
        {ab: DirectionOverride(down=True, loss_pct=5), ba: DirectionOverride(loss_pct=5, extra_delay_ms=20 * d)},
        {ab: DirectionOverride(down=True, loss_pct=5), ba: DirectionOverride(loss_pct=5)},  # t=2: delay ends
        {ab: DirectionOverride(loss_pct=5), ba: DirectionOverride(loss_pct=5)},  # t=3: a->b back up
    ]
    impairs = [arg for _, kind, arg in states if kind == "impair"]
    assert impairs == [*expected, {}], states  # t=4: the loss is over, nothing left
    assert [arg for _, kind, arg in states if kind == "rate"] == [("a", "b", 100_000)]  # mapped to the wire
    # Each call at its emulated time (0.5 emulated s = 100 ms of slack for a loaded host).
    assert [when for when, _, _ in states] == pytest.approx([1, 1, 2, 2, 3, 4, 4], abs=0.5)
    assert [e.applied_s is not None and e.error is None for e in log] == [True] * 4
    assert log[0].cleared_s == pytest.approx(3, abs=0.5) and log[3].cleared_s is None
    assert "a->b down" in log[0].detail and "at 100.0 Mbit/s" in log[3].detail


def test_kill_sends_sigkill_to_the_recorded_worker_and_late_faults_are_reported() -> None:
    victim = subprocess.Popen(["sleep", "30"])
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        # A record whose start time is not the process's names a PID that was reused.
        reused = _Proc(bystander.pid, "worker-prefill", (netns.proc_starttime(bystander.pid) or 0) + 1)
        inj = FaultInjector(FakeNetwork(processes=[reused]), [parse_fault("kill@0:host=prefill")])  # type: ignore[arg-type]
        inj.start()
        time.sleep(0.1)
        assert "already ended: nothing killed" in inj.stop()[0].detail
        assert bystander.poll() is None
        net = FakeNetwork(processes=[_Proc(victim.pid, "worker-relay", netns.proc_starttime(victim.pid))])
        inj = FaultInjector(net, [parse_fault("kill@0.01:host=relay"), parse_fault("kill@100:host=relay"),  # type: ignore[arg-type]
                                  parse_fault("broker-restart@0.02")])
        inj.start()
        assert victim.wait(timeout=5) == -signal.SIGKILL
        time.sleep(0.1)
        log = inj.stop()
    finally:
        victim.kill()
        bystander.kill()
        bystander.wait()
    assert [e.fault for e in log] == ["kill@0.01:host=relay", "broker-restart@0.02", "kill@100:host=relay"]
    assert log[0].applied_s is not None and f"pid {victim.pid}" in log[0].detail
    assert log[1].error == "RuntimeError: no broker in this run"  # reported, never silently skipped
    assert log[2].applied_s is None and log[2].error == "not applied: the replay ended first"


def test_failures_name_the_faults_in_effect_while_the_request_lived() -> None:
    log = [AppliedFault(fault="wan-down@10+5", kind="wan-down", at_s=10, applied_s=10.0, cleared_s=15.0),
           AppliedFault(fault="kill@20:host=relay", kind="kill", at_s=20, applied_s=20.0),
           AppliedFault(fault="loss@1:pct=5", kind="loss", at_s=1, error="not applied: the replay ended first")]
    out = annotate_failures({"early": (1.0, 9.0, "timed out"), "during": (8.0, 12.0, "worker decode-b died"),
                             "late": (16.0, 25.0, "worker relay died")}, log)
    assert out == {"early": "timed out", "during": "worker decode-b died (during fault wan-down@10+5)",
                   "late": "worker relay died (during fault kill@20:host=relay)"}


def test_the_default_scenario_has_no_faults() -> None:
    from testbed.scenario import load_scenario

    assert load_scenario(Path(TOPOLOGIES / "two-dc.yaml")).faults == []


def test_a_fault_for_good_takes_no_duration() -> None:
    assert parse_fault("broker-stop@5").kind == "broker-stop" and parse_fault("router-kill@0").duration_s is None
    for spec in ("broker-stop@5+2", "router-kill@1+10"):
        with pytest.raises(InputError, match="takes no duration: it lasts until the run ends"):
            parse_fault(spec)
