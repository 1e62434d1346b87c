"""Link traces: read and checked once (errors name file:line), turned into the fault
timeline per direction (rates mapped like any rate fault), and the line's rate over a run
rebuilt from the faults as applied (what the timeline plot draws)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault
from testbed.faults.wan_trace import MAHIMAHI_PACKET_BYTES, faults_of, load_wan_trace, rate_history

from .conftest import ROOT, TOPOLOGIES, run_cli_output, scenario_with

SHIPPED = sorted((ROOT / "traces" / "wan").glob("*.csv"))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_steps_absolute_and_relative(tmp_path: Path) -> None:
    t = load_wan_trace(_write(tmp_path, "a.csv", "# a comment\nt_s,rate_mbit,delay_ms,loss_pct\n0,500\n"
                                                   "10,100,30,1.5  # brownout\n20,500,,\n"))
    assert not t.relative and [(s.t_s, s.rate_mbit, s.delay_ms, s.loss_pct) for s in t.steps] == [
        (0.0, 500.0, None, None), (10.0, 100.0, 30.0, 1.5), (20.0, 500.0, None, None)]
    assert load_wan_trace(_write(tmp_path, "r.csv", "t_s,rate_pct\n0,50\n")).relative


@pytest.mark.parametrize(("text", "error"), [
    ("t_s,mbps\n0,1\n", "r.csv:1: (header): expected t_s,rate_mbit or t_s,rate_pct first"),
    ("0,fast\n", "r.csv:1: rate_mbit: not a number: 'fast'"),
    ("0,10\n5,10\n5,20\n", "r.csv:3: t_s: 5 does not follow 5"),
    ("0,10,1,2,3\n", "r.csv:1: (line): expected t_s,rate_mbit[,delay_ms[,loss_pct]], got 5 fields"),
    ("0,0\n", "r.csv:1: rate_mbit"),
    ("0,10,5,100\n", "r.csv:1: loss_pct"),
    ("# nothing\n", "no step in this link trace"),
])
def test_a_bad_csv_trace_names_file_line_and_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(InputError, match=error.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_wan_trace(_write(tmp_path, "r.csv", text))


def test_mahimahi_delivery_opportunities_become_rates(tmp_path: Path) -> None:
    # 3 packets in the first second, none in the second (a trickle, not zero), 3 in the third.
    t = load_wan_trace(_write(tmp_path, "link.trace", "0\n10\n999\n2000\n2001\n2500\n"))
    per_packet = MAHIMAHI_PACKET_BYTES * 8 / 1e6
    assert t.format == "mahimahi"
    assert [s.t_s for s in t.steps] == [0.0, 1.0, 2.0]
    assert [s.rate_mbit for s in t.steps] == pytest.approx([3 * per_packet, per_packet, 3 * per_packet])
    with pytest.raises(InputError, match=r"link2.trace:2: \(line\): 5 ms goes back in time"):
        load_wan_trace(_write(tmp_path, "link2.trace", "10\n5\n"))


def test_a_trace_becomes_faults_per_direction_and_its_rate_history(tmp_path: Path) -> None:
    trace = _write(tmp_path, "b.csv", "t_s,rate_pct,delay_ms,loss_pct\n0,100,15,0\n40,10,35,2\n70,100,15,0\n")
    sc = scenario_with({"wan": {"forward": {"rate_mbit": 1000, "delay_ms": 15.0, "trace": str(trace)}}})
    faults = faults_of(sc.wan_directions())
    assert [f.label for f in faults] == ["rate@0+40:dir=a->b,mbit=1000", "rate@40+30:dir=a->b,mbit=100",
                                         "delay@40+30:dir=a->b,ms=20", "loss@40+30:dir=a->b,pct=2",
                                         "rate@70:dir=a->b,mbit=1000"]
    applied = [AppliedFault(fault=f.label, kind=f.kind, at_s=f.at_s, applied_s=f.at_s + 0.01,
                            cleared_s=None if f.end_s is None else f.end_s + 0.01) for f in faults]
    history = rate_history(sc.wan_directions(), applied)
    assert history["a->b"] == [(0.0, 1000.0), (40.01, 100.0), (70.01, 1000.0)]
    assert history["b->a"] == [(0.0, sc.wan.reverse.rate_mbit)]  # no trace there


def test_a_delay_below_the_lines_own_is_refused_when_the_scenario_is_read(tmp_path: Path) -> None:
    trace = _write(tmp_path, "d.csv", "0,100,5\n")
    with pytest.raises(InputError, match="delay_ms 5 is below the scenario's 15 ms for a->b"):
        scenario_with({"wan": {"forward": {"delay_ms": 15.0, "trace": str(trace)}}})


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_the_shipped_traces_fit_the_shipped_scenarios(path: Path) -> None:
    from testbed.scenario import load_scenario

    for name in ("two-dc.yaml", "paper.yaml"):
        both = {"forward": {"trace": str(path)}, "reverse": {"trace": str(path)}}
        sc = load_scenario(TOPOLOGIES / name, {"wan": both})
        assert len(faults_of(sc.wan_directions())) >= 2 * len(load_wan_trace(path).steps)


def test_a_bad_wan_trace_on_the_command_line_exits_2_naming_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path, "bad.csv", "0,10\n0,20\n")
    code, _, err = run_cli_output(["run", "--engine", "sim", "--trace", "traces/agentic-quick.jsonl",
                                   "--wan-trace", str(bad)], capsys)
    assert code == 2 and "bad.csv:2: t_s: 0 does not follow 0" in err, err


def test_an_emulated_run_keeps_the_trace_in_emulated_units_and_the_wire_line_plain() -> None:
    from testbed.deploy.emulation import EmulationPlan

    trace = ROOT / "traces" / "wan" / "brownout.csv"
    sc = scenario_with({"wan": {"forward": {"trace": str(trace)}}}, emulated=True)
    wire = EmulationPlan.make(sc, 4, 2.5, 4096).wire_scenario(sc)  # delays x 2.5: below the trace's 35 ms no more
    assert wire.wan.forward.trace is None and wire.wan.forward.delay_ms == 2.5 * sc.wan.forward.delay_ms
    assert any(f.kind == "delay" and f.ms == 20 for f in faults_of(sc.wan_directions()))  # emulated: 35 - 15
