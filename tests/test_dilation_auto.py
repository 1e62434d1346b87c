"""``--dilation auto``: the probe's stretch of the trace and its stricter test, the choice kept
per scenario, trace and host (and raised after a failed verdict), and the whole choice on a
host with a deliberately busy core: the run passes, or says why not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from protocol.worker_config import DeviceReport
from testbed.analysis.results import load_run
from testbed.deploy import dilation_cache
from testbed.deploy.dilation import emulation_plan
from testbed.deploy.dilation_probe import PROBE_LATE_SHARE, busiest_requests, late_by_role
from testbed.load.trace_replay import probe_replay
from testbed.scenario import load_scenario
from testbed.traces.formats import load_trace
from testbed.traces.workload import RequestSpec

from .conftest import ROOT, TOPOLOGIES, needs_root


def test_the_probe_replays_the_busiest_stretch_with_turns_cut_loose_from_what_it_leaves_out() -> None:
    specs = [RequestSpec("a", [1], 1, at=0.0), RequestSpec("b", [1], 1, at=5.0), RequestSpec("c", [1], 1, at=5.2),
             RequestSpec("d", [1], 1, after="b", delay=0.25), RequestSpec("e", [1], 1, after="a", delay=5.1),
             RequestSpec("f", [1], 1, at=9.0)]
    # Estimated sends: a 0, b 5.0, e 5.1, c 5.2, d 5.25, f 9: the densest three are e, c, d.
    window = busiest_requests(specs, 3)
    assert [s.rid for s in window] == ["e", "c", "d"]
    by = {s.rid: s for s in window}
    # e's predecessor (a) is not replayed: e is sent on its own, at its estimated time (t0 = 5.1).
    assert by["e"].after is None and by["e"].at == pytest.approx(0.0)
    assert by["c"].at == pytest.approx(0.1)
    # d's predecessor (b) is outside too; d becomes open-loop at 5.25 - 5.1.
    assert by["d"].after is None and by["d"].at == pytest.approx(0.15)
    assert [s.rid for s in busiest_requests(specs, 99)] == ["a", "b", "c", "d", "e", "f"]  # the whole trace


def _worker(role: str, steps: int, late: int, native: bool = False) -> SimpleNamespace:
    return SimpleNamespace(role=role, device=DeviceReport(device="x", native=native, steps=steps, late_wakes=late))


def test_a_probe_pools_each_roles_steps_and_allows_half_a_percent_of_them_late() -> None:
    # A run's verdict allows one late step in each of these workers; the probe allows none
    # of 110 prefill steps (0.5 % rounds down) and one of 400 decode steps.
    run = SimpleNamespace(workers={"p1": _worker("prefill", 40, 1), "p2": _worker("prefill", 70, 0),
                                   "d1": _worker("decode", 400, 1), "n": _worker("prefill", 9, 9, native=True)})
    assert PROBE_LATE_SHARE == 0.005
    assert late_by_role(run) == ["prefill: 1 of 110 steps late"]
    run.workers["p1"] = _worker("prefill", 40, 0)
    assert late_by_role(run) == []


def test_an_auto_choice_is_kept_per_inputs_and_host_raised_after_a_failure_and_never_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(dilation_cache.CACHE_ENV, str(tmp_path))
    sc, trace = TOPOLOGIES / "paper.yaml", ROOT / "traces" / "agentic-quick.jsonl"
    shape = "117 requests, the last sent at 90.000 s"
    key = dilation_cache.key_for(sc, trace, 16, shape)
    assert key != dilation_cache.key_for(sc, trace, 8, shape)
    assert key != dilation_cache.key_for(sc, trace, 16, "40 requests, the last sent at 30.000 s")
    assert key != dilation_cache.key_for(TOPOLOGIES / "two-dc.yaml", trace, 16, shape)
    assert dilation_cache.recall(key) is None
    dilation_cache.remember(key, 1.5, "auto: probed")
    assert dilation_cache.recall(key) == (1.5, "auto: probed")
    assert not list(tmp_path.glob(".*.tmp"))
    # A run at the kept D failed its verdict: the next one starts 1.5x higher.
    assert dilation_cache.failed_at(key, 1.5) == pytest.approx(2.3)  # 2.25, rounded up as every D is
    d, why = dilation_cache.recall(key)
    assert d == pytest.approx(2.3) and "failed its fidelity verdict" in why
    # Read, not trusted: a file that is not an entry, or a dilation out of range, is ignored.
    path = tmp_path / f"{key}.json"
    for bad in ("not json", json.dumps([1]), json.dumps({"version": 1, "dilation": 1e9, "why": "x", "at": time.time()}),
                json.dumps({"version": 1, "dilation": True, "why": "x", "at": time.time()}),
                "[" * 100_000):
        path.write_text(bad)
        assert dilation_cache.recall(key) is None
        assert "ignoring" in capsys.readouterr().out
    # An old entry is probed again.
    path.write_text(json.dumps({"version": 1, "dilation": 2.0, "why": "x", "at": time.time() - 30 * 86400}))
    assert dilation_cache.recall(key) is None and "older than" in capsys.readouterr().out
    monkeypatch.setenv(dilation_cache.CACHE_ENV, "off")
    dilation_cache.remember(key, 3.0, "off")
    assert dilation_cache.recall(key) is None


@pytest.mark.serial
@needs_root
def test_auto_on_a_host_with_a_busy_core_passes_or_says_why_and_the_next_run_reuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A core kept busy by another process (what a shared host does to a run): the probe
    measures the host as it is, so the run at the chosen dilation passes its verdict (and keeps
    it, or what its steps needed if lower), or exits 3 with the reason and keeps a higher
    dilation for the next run, which takes it without probing."""
    raw = yaml.safe_load((TOPOLOGIES / "paper.yaml").read_text())  # modeled: the probe builds the deployment
    keep = {"client", "router", "prefill-1", "prefill-2", "relay", "decode-a1", "decode-b1"}
    for dc in raw["datacenters"].values():
        dc["hosts"] = {h: spec for h, spec in dc["hosts"].items() if h in keep}
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session": f"s{i}", "start_s": 0.4 * i, "turns": [
        {"new_tokens": 1500, "output_tokens": 120}]}) + "\n" for i in range(6)))
    cache = tmp_path / "cache"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = subprocess.run([sys.executable, "-m", "testbed", "run", "--scenario", str(scenario), "--trace",
                                str(trace), "--token-scale", "16", "--policies", "pdd", "--dilation", "auto", "--out",
                                str(tmp_path / "one")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, dilation_cache.CACHE_ENV: str(cache)})
    finally:
        busy.kill()
        busy.wait()
    out = first.stdout + first.stderr
    assert "dilation auto: probe at D 0.5" in out, out[-3000:]
    summary, _ = load_run(tmp_path / "one")
    fidelity = summary.policies["pdd"].fidelity
    if first.returncode == 0:
        assert fidelity.passed
    else:  # refused, with the reason, and the next run starts higher
        assert first.returncode == 3 and not fidelity.passed and fidelity.reasons, out[-3000:]
        assert "the next auto run of this scenario and trace here starts at D" in first.stderr
    # The next run of the same inputs here: the kept choice, no probe.
    monkeypatch.setenv(dilation_cache.CACHE_ENV, str(cache))
    sc, wl = load_scenario(scenario), load_trace(trace, "auto", 16)
    plan = emulation_plan(sc, wl, wl.specs(1.0), "auto", replay=probe_replay)
    said = capsys.readouterr().out
    assert "kept from an earlier run of this scenario and trace on this host" in said and "probe at D" not in said
    d = summary.emulation.dilation
    if first.returncode == 0:  # kept, or lowered to what its steps needed (and said so)
        assert plan.dilation == d or (plan.dilation < d and "the next auto run of this scenario" in first.stdout)
    else:
        assert plan.dilation > d
    assert plan.auto_key is not None


def test_the_verdicts_move_the_kept_dilation_down_to_what_the_steps_needed_and_never_back_to_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dilation_cache.CACHE_ENV, str(tmp_path))
    key = dilation_cache.key_for(TOPOLOGIES / "two-dc.yaml", ROOT / "traces" / "agentic-quick.jsonl", 16, "x")
    dilation_cache.remember(key, 3.7, "auto: probed x 2 margin")
    assert dilation_cache.recall(key) == (3.7, "auto: probed x 2 margin")
    # Passed at 3.7, every step would have kept up at 0.5 x it: the next run takes 0.5 x 1.25 x 3.7.
    assert dilation_cache.passed_at(key, 3.7, 0.5) == pytest.approx(2.4)  # 2.3125, rounded up
    d, why = dilation_cache.recall(key)
    assert d == pytest.approx(2.4) and "needing 0.50 x it" in why
    assert dilation_cache.passed_at(key, 2.4, 0.9) is None  # no lower: the kept one stands
    assert dilation_cache.passed_at(key, 2.4, None) is None
    # Failed at 2.4: up by 1.5, and 2.4 is remembered as too low here...
    assert dilation_cache.failed_at(key, 2.4, 1.1) == pytest.approx(3.6)
    d, _ = dilation_cache.recall(key)
    assert d == pytest.approx(3.6)
    # ...so a later pass that says 0.5 goes down no further than 1.25 x 2.4.
    assert dilation_cache.passed_at(key, 3.6, 0.5) == pytest.approx(3.0)
    d, why = dilation_cache.recall(key)
    assert d == pytest.approx(3.0) and "D 2.4 (failed here)" in why
