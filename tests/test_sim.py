"""The simulator end to end (no root, no namespaces): every policy on the shipped scenarios,
the same records from the same inputs in any process, refusals by name, faults in emulated
time, and proof that what runs is the deployment's own code, not a copy of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from control.router import Router
from protocol import clock
from protocol.messages import KvSent
from protocol.worker_config import WorkerFaults
from testbed.errors import InputError
from testbed.faults.timeline import parse_fault
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.policies.pdd import Pdd
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.sim.scope import check_simulable
from testbed.traces import load_trace
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.decode import DecodeWorker
from workers.device import Pacer
from workers.prefill import PrefillWorker
from workers.radix_cache import RadixCache

from .conftest import ROOT, TOPOLOGIES, run_cli_output, scenario_with

QUICK = ["--trace", "traces/agentic-quick.jsonl", "--token-scale", "16", "--engine", "sim"]


def _sim_run(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> tuple[int, dict[str, Any], pd.DataFrame]:
    code, stdout, err = run_cli_output(["run", *QUICK, "--out", str(out), *args], capsys)
    assert code in (0, 1), err[-2000:]
    return code, json.loads((out / "summary.json").read_text()), pd.read_csv(out / "requests.csv")


@pytest.mark.parametrize(("scenario", "policy", "pipelines", "crosses"), [
    ("two-dc.yaml", "same-dc", {"P-D(a)"}, False),
    ("two-dc.yaml", "cross-dc", {"P-D(b)"}, True),
    ("two-dc.yaml", "pdd", {"P-MD", "P-RLD-MD", "P-RLD"}, True),
    ("offload.yaml", "prefill-offload", {"P-D(a)", "P(b)-D(a)"}, None),  # offloads only long, uncached prefills
])  # fmt: skip
def test_every_policy_runs_in_the_simulator(capsys: pytest.CaptureFixture[str], tmp_path: Path, scenario: str,
                                            policy: str, pipelines: set[str], crosses: bool | None) -> None:
    code, summary, rows = _sim_run(capsys, tmp_path, "--scenario", str(TOPOLOGIES / scenario), "--limit", "30",
                                   "--policies", policy)
    s = summary["policies"][policy]
    assert code == 0 and summary["engine"] == "sim" and s["failed"] == 0 and s["completed"] == 30
    assert set(s["pipelines"]) <= pipelines and s["pipelines"], s["pipelines"]
    assert crosses is None or (s["wan_kv_bytes"] > 0) == crosses
    assert rows.ttft_s.notna().all() and (rows.ttft_s > 0).all() and (rows.tpot_s.dropna() > 0).all()
    assert summary["emulation"]["dilation"] == 1.0 and "simulated" in summary["emulation"]["dilation_reason"]
    if policy in ("cross-dc", "pdd"):  # a session's later turns find their history at the main decoder
        md = rows[rows.pipeline != "P-RLD"].decode_hit  # (none where a cut-off kept the KV from it)
        assert md.notna().sum() > 20 and md.max() > 0.5 and s["hit_decode_mean"] == pytest.approx(md.mean())


def test_the_same_inputs_give_the_same_records_in_any_process(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    """Byte-identical requests.csv from this process and another with a different hash seed:
    no decision depends on set or dict order, a host clock or an unseeded draw."""
    args = ["run", *QUICK, "--limit", "30", "--policies", "pdd"]
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    proc = subprocess.run([sys.executable, "-m", "testbed", *args, "--out", str(tmp_path / "other")], cwd=ROOT,
                          env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, _, err = run_cli_output([*args, "--out", str(tmp_path / "here")], capsys)
    assert code == 0, err[-2000:]
    assert (tmp_path / "other" / "requests.csv").read_bytes() == (tmp_path / "here" / "requests.csv").read_bytes()


def test_what_the_simulator_cannot_represent_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InputError, match="emulation: the simulator prices every step"):
        check_simulable(scenario_with())  # no emulated model: the host CPU times its workers
    native_prefill = scenario_with({"datacenters": {"a": {"hosts": {"prefill": {"device": "native"}}}}},
                                   emulated=True)
    with pytest.raises(InputError, match=r"hosts\.prefill\.device: native has no roofline"):
        check_simulable(native_prefill)
    sc = scenario_with(emulated=True)
    with pytest.raises(InputError, match="worker faults"):
        SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16),
                      worker_faults={"prefill": WorkerFaults(die_after_tokens=3)})
    code, _, err = run_cli_output(["run", *QUICK, "--dilation", "2"], capsys)
    assert code == 2 and "--dilation: the simulator runs in emulated time" in err


def test_the_simulator_runs_the_deployments_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spies on the router, the policy, both worker roles, the radix cache and the device
    model: each is called as the requests flow (the simulator has none of its own)."""
    calls: dict[str, int] = {}

    def spy(cls: type, name: str) -> None:
        original = getattr(cls, name)
        key = f"{cls.__name__}.{name}"
        calls[key] = 0

        if name.startswith("_admit") or name in ("handle",):
            async def wrapped_async(self: Any, *a: Any, **k: Any) -> Any:
                calls[key] += 1
                return await original(self, *a, **k)
            monkeypatch.setattr(cls, name, wrapped_async)
        else:
            def wrapped(self: Any, *a: Any, **k: Any) -> Any:
                calls[key] += 1
                return original(self, *a, **k)
            monkeypatch.setattr(cls, name, wrapped)

    for cls, name in ((Router, "_admit"), (Pdd, "plan"), (Pdd, "handoff"), (PrefillWorker, "handle"),
                      (DecodeWorker, "handle"), (RadixCache, "match_prefix"), (Pacer, "decode_time"),
                      (Pacer, "prefill_time")):
        spy(cls, name)
    sc = scenario_with(emulated=True)
    plan = sim_plan(sc, 16)
    specs = [RequestSpec(f"r{i}", synth_tokens(f"own-{i % 3}", 300) + synth_tokens(f"new-{i}", 40), 150, at=0.2 * i)
             for i in range(12)]
    with SimDeployment(sc, parse_policy("pdd:relay_s=0"), emulation=plan) as dep:
        run = dep.run(TraceReplay(specs, 600, show_progress=False))
    assert all(r.ok for r in run.recs.values()), {k: r.error for k, r in run.recs.items()}
    assert calls["Router._admit"] == calls["Pdd.plan"] == 12
    assert calls["Pdd.handoff"] > 0  # relay_s=0: every request relays and hands over
    assert min(calls.values()) > 0, calls
    assert run.engine == "sim" and run.policy.counts.get("P-RLD-MD", 0) > 0


def test_faults_act_in_emulated_time_and_the_line_outage_costs_pdd_nothing() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(60)
    timeline = [parse_fault("wan-down@10+15"), parse_fault("broker-restart@40+2")]
    with SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16), timeline=timeline) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values()), {k: r.error for k, r in run.recs.items() if not r.ok}
    applied = {f.fault: f for f in run.faults}
    assert applied["wan-down@10+15"].applied_s == pytest.approx(10, abs=0.01)
    assert applied["wan-down@10+15"].cleared_s == pytest.approx(25, abs=0.01)
    assert applied["broker-restart@40+2"].applied_s == pytest.approx(40, abs=0.01)
    t0 = run.fault_t0
    wan = [(e.start - t0, e.end - t0) for rec in run.router.values() for e in rec.events
           if isinstance(e, KvSent) and e.to == "decode-b" and not e.cancelled]
    assert not [w for w in wan if 10 < w[1] < 25], wan  # nothing crossed the line while it was down
    assert [w for w in wan if w[0] < 25 < w[1]]  # what was on its way waited for it
    assert run.deaths == []  # unreachable for a while, never declared dead


def test_a_killed_worker_fails_only_what_it_held_and_comes_back(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    code, summary, _ = _sim_run(capsys, tmp_path, "--limit", "40", "--policies", "pdd",
                                "--fault", "kill@6+4:host=relay", "--retries", "0")
    s = summary["policies"]["pdd"]
    kill = s["faults"][0]
    assert kill["applied_s"] == pytest.approx(6, abs=0.01) and kill["cleared_s"] == pytest.approx(10, abs=0.01)
    assert "ended at once" in kill["detail"]
    # What the relay held fails with its name and the fault's (and a session's next turns are
    # not sent); the rest completes.
    held = [why or "" for why in s["failures"].values() if not (why or "").startswith("not sent: previous turn")]
    assert held and all("worker relay died" in why and "kill@6+4" in why for why in held), s["failures"]
    assert s["completed"] + s["failed"] == 40 and s["completed"] >= 30


def test_a_slow_replay_of_a_costlier_prefill_ends_without_an_event_storm(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    """A tenth of the report's load with a prefill 16x costlier per token: before the flow model
    ended a flow within a microsecond of its end, a transfer a fraction of a byte short was
    rescheduled at "now" millions of times (100 requests: 18 minutes, unfinished)."""
    import time

    t0 = time.monotonic()
    code, stdout, err = run_cli_output(["run", "--engine", "sim", "--scenario", str(TOPOLOGIES / "paper.yaml"),
                                        "--trace", "traces/paper.jsonl", "--token-scale", "16", "--limit", "100",
                                        "--load", "0.1", "--prefill-cost", "16", "--policies", "same-dc",
                                        "--out", str(tmp_path)], capsys)
    assert code == 0, err[-2000:]
    assert time.monotonic() - t0 < 60
    summary = json.loads((tmp_path / "summary.json").read_text())
    h100 = summary["scenario"]["devices"]["h100"]
    assert h100["compute_efficiency"] == pytest.approx(0.488 / 16)  # the run says what it priced
    assert h100["decode_compute_efficiency"] == pytest.approx(0.222)
    assert summary["policies"]["same-dc"]["completed"] == 100


def test_sigterm_ends_a_simulation_as_ctrl_c_does(tmp_path: Path) -> None:
    """asyncio logs and swallows what a signal handler raises inside a callback unless it is a
    KeyboardInterrupt: SIGTERM once left a simulation running."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--engine", "sim", "--scenario",
                             str(TOPOLOGIES / "paper.yaml"), "--trace", "traces/paper.jsonl", "--token-scale", "16",
                             "--limit", "2000", "--policies", "pdd", "--out", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("engine: the simulator"):
                break
        time.sleep(0.3)  # inside the replay
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_validate_compares_every_policy_and_marks_one_whose_emulation_failed_its_verdict(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A policy whose emulation failed its fidelity verdict is shown beside the simulator's,
    marked and not judged; the others are compared as ever (a failed verdict once discarded
    a 44-minute emulation: "nothing to compare with")."""
    from testbed.experiments.validation import compare, format_result

    emu, sim = tmp_path / "emulation", tmp_path / "sim"
    _sim_run(capsys, sim, "--limit", "10", "--policies", "same-dc,cross-dc")
    shutil.copytree(sim, emu)
    summary = json.loads((emu / "summary.json").read_text())
    summary["policies"]["cross-dc"]["fidelity"].update(passed=False, reasons=["5 of 226 WAN frames late"])
    (emu / "summary.json").write_text(json.dumps(summary))
    result = compare(emu, sim)
    by_policy = {p: [f for f in result.figures if f.policy == p] for p in ("same-dc", "cross-dc")}
    assert result.unjudged == ["cross-dc"] and result.passed
    assert by_policy["cross-dc"] and all(not f.judged and f.passed is None for f in by_policy["cross-dc"])
    assert by_policy["same-dc"] and any(f.passed for f in by_policy["same-dc"])
    assert all(f.judged for f in by_policy["same-dc"])
    text = format_result(result)
    assert "not judged (fidelity)" in text and "not judged: cross-dc" in text


def test_an_exception_while_shipping_kv_fails_that_request_never_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception out of a transfer (not only a transfer error: once an OverflowError of the
    link model) fails the request it carried with the exception named; the prefill goes on."""
    from testbed.sim.kv import SimTransport

    send_kv = SimTransport.send_kv
    broken: list[str] = []

    async def flaky(self: SimTransport, host: str, port: int, request_id: str, *args: Any, **kw: Any) -> Any:
        if not broken:
            broken.append(request_id)
            raise OverflowError("int too large to convert to float")
        return await send_kv(self, host, port, request_id, *args, **kw)

    monkeypatch.setattr(SimTransport, "send_kv", flaky)
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(12)
    with SimDeployment(sc, parse_policy("cross-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    failed = {rid: r.error for rid, r in run.recs.items() if not r.ok}
    assert broken and broken[0] in failed
    assert all((why or "").startswith("not sent") for rid, why in failed.items() if rid != broken[0]), failed
    assert "KV transfer to decode-b: OverflowError: int too large" in (failed[broken[0]] or "")
    assert run.component_errors == [] and run.deaths == []


def test_a_bug_in_a_component_fails_what_it_touched_and_the_run_says_so(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no component caught (here the link model's, once) is counted in the
    summary with its name, fails the transfers it touched, and the run exits 1 saying so."""
    from testbed.sim.flows import Flows

    cap = Flows._cap
    calls = [0]

    def once(self: Flows, f: Any, now: float) -> float:
        calls[0] += 1
        if calls[0] < 1000 and f.sent > 0 and f.remaining > f.size / 2:  # once, mid-transfer
            calls[0] = 1000
            raise OverflowError("int too large to convert to float")
        return cap(self, f, now)

    monkeypatch.setattr(Flows, "_cap", once)
    code, stdout, err = run_cli_output(["run", *QUICK, "--out", str(tmp_path), "--limit", "12", "--policies",
                                        "cross-dc", "--retries", "0"], capsys)
    s = json.loads((tmp_path / "summary.json").read_text())["policies"]["cross-dc"]
    assert code == 1 and calls[0] > 1000
    assert s["component_errors"] and "OverflowError" in s["component_errors"][0]
    assert any("the link model failed: OverflowError" in (why or "") for why in s["failures"].values())
    assert "exception(s) no component caught" in err


def test_the_router_refuses_what_no_worker_could_hold_and_serves_the_rest() -> None:
    """Bounded at the first reader: a prompt past the wire's longest, prompt and output past
    the model's context, an id past its vocabulary: each fails alone with its reason; no
    worker hears of it, none ends, and the requests beside them complete."""
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    ok = synth_tokens("ok", 64)
    specs = [RequestSpec("huge", [5] * ((1 << 20) + 1), 4), RequestSpec("long", [5] * ((1 << 20) - 2), 8),
             RequestSpec("vocab", [*ok[:10], 9000, *ok[10:]], 4), RequestSpec("fine", ok, 4, at=0.1)]
    with SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(specs, 600, show_progress=False))
    errors = {rid: r.error or "" for rid, r in run.recs.items()}
    assert errors["fine"] == "" and run.recs["fine"].ok
    assert "prompt" in errors["huge"] and "1048576" in errors["huge"], errors["huge"]
    assert "exceed the model's context of 1048576 tokens" in errors["long"], errors["long"]
    assert "token id 9000 is outside the model's vocabulary (0..8191)" in errors["vocab"], errors["vocab"]
    assert set(run.router) == {"fine"}  # the refused were never planned nor given to a worker
    assert run.component_errors == [] and run.deaths == []


@pytest.mark.parametrize("fault", ["broker-stop@8", "router-kill@8"])
def test_a_broker_or_router_gone_for_good_ends_every_request_with_a_reason(fault: str) -> None:
    """Nothing hangs until the client's timeout: open requests fail once the broker has been
    unreachable (or the router's last will has said "down") for the grace period, the later
    ones are not sent, and what the router finished before is in its records."""
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(40)
    with SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16), timeline=[parse_fault(fault)]) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 1800, show_progress=False))
    last = max(r.ended or 0 for r in run.recs.values()) - run.fault_t0
    assert all(r.done and (r.ok or r.error) for r in run.recs.values())
    assert last < 8 + 60  # ended within the grace after the fault, not at the 1,800 s timeout
    t0 = run.fault_t0
    done_before = {rid for rid, r in run.recs.items() if r.ok and (r.ended or 0) - t0 < 7.5}
    failed = [r.error or "" for r in run.recs.values() if not r.ok]
    assert done_before and failed  # (decoders streaming when the router died may still finish)
    why = "broker unreachable" if fault.startswith("broker") else "router down"
    assert all(why in e or e.startswith("not sent: previous turn") for e in failed), failed
    assert done_before <= set(run.router)  # a router killed loses no record of what it finished
    assert run.faults[0].applied_s == pytest.approx(8, abs=0.01) and run.component_errors == []


def test_a_components_wall_clock_stepped_either_way_changes_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every latency, deadline and stamp is on a clock no wall-clock step moves: the same
    replay with the client's clock an hour back, the router's a day ahead and decode-b's
    stepped and stepped back gives the same records, to the bit; each component read its
    own stepped clock meanwhile (``protocol.clock.wall``)."""
    seen: dict[str, list[tuple[float, float]]] = {}

    def spy(cls: Any, name: str, who: Callable[[Any], str]) -> None:
        original = getattr(cls, name)

        async def wrapped(self: Any, *a: Any, **k: Any) -> Any:
            seen.setdefault(who(self), []).append((clock.now(), clock.wall()))
            return await original(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)

    spy(Router, "_admit", lambda _: "router")
    spy(DecodeWorker, "handle", lambda w: w.cfg.name)
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(40)
    runs = []
    for timeline in ([], ["clock-step@1:host=client,s=-3600", "clock-step@2:host=router,s=86400",
                          "clock-step@5+10:host=decode-b,s=-7200", "clock-step@20:s=30"]):
        seen.clear()
        with SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16),
                           timeline=[parse_fault(f) for f in timeline]) as dep:
            runs.append(dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False)))
            t0 = dep.injector.t0_stamp
    plain, stepped = runs
    assert all(f.applied_s is not None and f.error is None for f in stepped.faults), stepped.faults
    assert "router +86400 s" in stepped.faults[1].detail and "decode-b +30 s" in stepped.faults[3].detail
    assert all(r.ok for r in stepped.recs.values())
    for rid, a in plain.recs.items():
        b = stepped.recs[rid]
        assert (a.sent, a.ended, list(a.token_times), list(a.tokens)) == (b.sent, b.ended, list(b.token_times),
                                                                           list(b.tokens)), rid
        assert plain.router[rid] == stepped.router[rid], rid
    # What decode-b read off its own wall clock while stepped, and after it was stepped back.
    skew = {round(w - now) for now, w in seen["decode-b"] if 6 < now - t0 < 14}
    after = {round(w - now) for now, w in seen["decode-b"] if now - t0 > 21}
    assert skew == {-7200} and after == {30}, (skew, after)
    assert {round(w - now) for now, w in seen["router"] if 3 < now - t0 < 19} == {86400}


def test_trace_decisions_saves_each_plan_with_what_it_weighed_and_changes_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain, traced = tmp_path / "plain", tmp_path / "traced"
    _sim_run(capsys, plain, "--limit", "12", "--policies", "pdd")
    _sim_run(capsys, traced, "--limit", "12", "--policies", "pdd", "--trace-decisions")
    assert (plain / "requests.csv").read_bytes() == (traced / "requests.csv").read_bytes()
    lines = [json.loads(x) for x in (traced / "decisions-pdd.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and all(d["pipeline"] in ("P-MD", "P-RLD-MD") for d in lines)
    for d in lines:
        chosen = {c["worker"] for c in d["candidates"] if c["note"].endswith("(chosen)")}
        assert {d["prefill"], d["decode"]} <= chosen and d["info"]["delta_tokens"] is not None
    assert not list(plain.glob("decisions-*"))


def test_a_run_with_the_simulators_prediction_prints_it_first_then_both_side_by_side(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --with-sim`` (what ``make run-trace`` runs): the simulator's tables first, then the
    run's, then the comparison with validate's tolerances, saved in the run's folder; the
    exit status is the run's. (The emulation is stood in for by a second simulation: the
    orchestration is what is tested here, the emulation by ``test_sim_validation``.)"""
    import dataclasses

    from testbed.experiments import validation

    real = validation.run_trace
    engines: list[str] = []

    def stand_in(sc: Any, wl: Any, policies: Any, opts: Any) -> int:
        engines.append(opts.engine)
        return real(sc, wl, policies, dataclasses.replace(opts, engine="sim", dilation=None))

    monkeypatch.setattr(validation, "run_trace", stand_in)
    code, out, err = run_cli_output(["run", "--trace", "traces/agentic-quick.jsonl", "--token-scale", "16", "--limit",
                                     "8", "--policies", "same-dc,pdd", "--with-sim", "--out", str(tmp_path)], capsys)
    assert code == 0, err[-2000:]
    assert engines == ["sim", "emulation"]
    first, second = out.index("THE SIMULATOR's prediction"), out.index("== the emulation")
    assert first < second < out.index("the simulator's prediction beside the emulation")
    assert (tmp_path / "sim" / "summary.json").exists() and (tmp_path / "summary.json").exists()
    result = json.loads((tmp_path / "validation.json").read_text())
    assert result["figures"] and all(f["passed"] is not False for f in result["figures"])
    code, out, _ = run_cli_output(["run", "--engine", "sim", "--trace", "traces/agentic-quick.jsonl", "--token-scale",
                                   "16", "--limit", "4", "--with-sim", "--out", str(tmp_path / "s")], capsys)
    assert code == 0 and "THE SIMULATOR's prediction" not in out  # the simulator's run is its own prediction
