"""Faults on a running emulation (root): the delay line obeys the injector, and requests
survive what can be survived, end with a reason naming the fault otherwise, and never hang."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from protocol.messages import Done, KvReceived, KvSent
from protocol.router_config import RequestRecord
from testbed.analysis.fault_impact import fault_impacts
from testbed.deploy.deployment import Deployment
from testbed.faults.timeline import parse_fault
from testbed.load.replay_client import ROUTER_GRACE_S
from testbed.load.retry import NO_RETRY, RetryPolicy, attempt_rid
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare, verification_prompts
from testbed.net import measure
from testbed.net.delayline import STATS_PERIOD_S
from testbed.net.delayline_contract import DirectionOverride
from testbed.policies import parse_policy
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model import ModelRunner, ensure_default_model

from .conftest import ROOT, built, needs_root, scenario_with, small_wan

pytestmark = needs_root


@pytest.mark.serial  # times the delay line's round trips to +-3 ms: no neighbour on the cores
def test_delay_line_takes_a_direction_down_adds_delay_and_loss_and_restores() -> None:
    with built(small_wan(5.0, None)) as net:
        src, dst = net.ns_of("ha"), net.ip_of("hc")
        assert measure.ping(src, dst, count=10).received == 10
        net.impair_wan({("a", "b"): DirectionOverride(down=True)})
        time.sleep(0.05)
        assert measure.ping(src, dst, count=10, timeout_s=0.5, warmup=0).received == 0
        net.impair_wan({("b", "a"): DirectionOverride(extra_delay_ms=20.0)})  # a->b back up
        time.sleep(0.05)
        slow = measure.ping(src, dst, count=10)
        assert slow.received == 10 and 2 * 5 + 20 - 1 <= slow.median_ms <= 2 * 5 + 20 + 3, slow.rtts_ms
        net.impair_wan({("a", "b"): DirectionOverride(loss_pct=50.0)})
        lossy = measure.ping(src, dst, count=200, interval_s=0.002, timeout_s=0.5)
        assert 25 <= lossy.loss_pct <= 75, lossy.loss_pct
        net.impair_wan({})
        time.sleep(0.05)
        back = measure.ping(src, dst, count=10)
        assert back.received == 10 and abs(back.median_ms - 10) < 1.5
        time.sleep(2 * STATS_PERIOD_S)
        stats = net.delayline_stats()
    assert stats is not None and stats.directions["a->b"].drop_fault >= 10  # counted, by cause
    assert stats.directions["a->b"].drop_loss > 0 and stats.directions["b->a"].drop_fault == 0


def test_a_rate_fault_changes_the_line_and_its_end_restores_it() -> None:
    from testbed.net import netns

    def rate_of(net, dst: str) -> int:  # noqa: ANN001
        with netns.iproute(net.plan.wan_ns) as ipr:
            idx = ipr.link_lookup(ifname=net.plan.dcs[dst].wan_port)[0]
            cls = [c for c in ipr.get_classes(index=idx) if c.get("handle") == 0x10010]
        return cls[0].get_nested("TCA_OPTIONS", "TCA_HTB_PARMS")["rate"] * 8

    with built(small_wan(5.0, 100)) as net:
        net.set_wan_rate("a", "b", 20_000_000)
        assert rate_of(net, "b") == 20_000_000 and rate_of(net, "a") == 100_000_000
        g = measure.goodput(net.ns_of("ha"), net.ns_of("hc"), net.ip_of("hc"), seconds=1.5, warmup=1.0,
                            window_bytes=measure.window_for(20e6, 0.010, net.plan.wan_shaping[("a", "b")].queue_bytes))
        assert 0.85 * 20e6 <= g.bits_per_second <= 1.1 * 20e6, g
        net.set_wan_rate("a", "b", None)
        assert rate_of(net, "b") == 100_000_000


@pytest.fixture(scope="module")
def spread_prompts() -> tuple[list[RequestSpec], dict[str, list[int]]]:
    """Requests over ~5 s, each decoding 64 tokens (a fault lands while several are in flight,
    whatever the host's speed), with greedy references."""
    specs = [replace(s, at=0.3 * i, max_new=64) for i, s in enumerate(verification_prompts(16, seed=5, max_len=768))]
    runner = ModelRunner(ensure_default_model(), "float64")
    return specs, {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}


def _run(policy: str, faults: list[str], specs: list[RequestSpec], timeout_s: float = 90,
         retry: RetryPolicy = NO_RETRY, workers: dict | None = None, logs_to: Path | None = None,
         router_grace_s: float = ROUTER_GRACE_S):
    sc = scenario_with({"workers": workers} if workers else None)
    with Deployment(sc, parse_policy(policy), dtype="float64", timeline=[parse_fault(f) for f in faults],
                    logs_to=logs_to) as dep:
        run = dep.run(TraceReplay(specs, timeout_s=timeout_s, retry=retry, router_grace_s=router_grace_s))
    return run.recs, run.router, run.faults, run


def _log_tails(folder: Path, lines: int = 15) -> str:
    """The last lines of every process's log a run kept: what a failure's message shows."""
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                     for p in sorted(folder.glob("*.log")))


def test_wan_outage_and_broker_restart_lose_nothing(spread_prompts, tmp_path: Path) -> None:
    """A WAN outage shorter than the broker's keepalive stalls transfers and streams, which
    then resume; a broker restart is ridden out by every component (persistent sessions,
    paho's resends): every request completes with exactly the reference tokens, and the
    results are those of a run without the faults."""
    specs, refs = spread_prompts
    recs, router, log, _ = _run("pdd:relay_s=0", ["wan-down@0.8+1.5", "broker-restart@2.5+0.5"], specs,
                                logs_to=tmp_path)
    assert all(e.applied_s is not None and e.error is None for e in log), log
    failed = {rid: r.error for rid, r in recs.items() if r.error}
    assert failed == {}, f"{failed}\n{_log_tails(tmp_path)}"
    assert compare(specs, refs, recs) == []  # no token missing, repeated or out of order
    assert all(list(r.token_times) == sorted(r.token_times) for r in recs.values())
    assert {router[s.rid].pipeline for s in specs} == {"P-RLD-MD"}
    # What was delivered twice across the restart (QoS 1) counts once (a repeated kv_sent
    # doubled a request's WAN bytes): no transfer, receipt or end is recorded twice, and each
    # request's transfers are those of a run without the faults. (A receipt that lands after its
    # request's record was kept is a race in either run: receipts are not compared between them.)
    _, calm, _, _ = _run("pdd:relay_s=0", [], specs)

    def recorded(rr: RequestRecord) -> Counter[tuple[str, str, str]]:
        return Counter((e.kind, e.worker, e.to if isinstance(e, KvSent) else "") for e in rr.events
                       if isinstance(e, (KvSent, KvReceived, Done)))

    twice = {rid: recorded(rr) for rid, rr in router.items() if max(recorded(rr).values()) > 1}
    assert twice == {}
    assert {rid: sorted(k for k in recorded(rr) if k[0] == "kv_sent") for rid, rr in router.items()} == \
        {rid: sorted(k for k in recorded(rr) if k[0] == "kv_sent") for rid, rr in calm.items()}
    wan = {rid: sum(e.bytes for e in rr.events if isinstance(e, KvSent) and e.to == "decode-b")
           for rid, rr in router.items()}
    calm_wan = {rid: sum(e.bytes for e in rr.events if isinstance(e, KvSent) and e.to == "decode-b")
                for rid, rr in calm.items()}
    # Equal but for a connection's opening (AUTH) where the outage made a transfer open another.
    assert all(abs(wan[rid] - calm_wan[rid]) <= 1024 for rid in wan), (wan, calm_wan)


@pytest.mark.parametrize(("fault", "why"), [("broker-stop@2", "broker unreachable"), ("router-kill@2", "router down")])
def test_a_broker_or_router_gone_for_good_ends_every_request_with_a_reason(spread_prompts, fault: str,
                                                                           why: str) -> None:
    """Killed for good: every request ends (completed, or failed naming what is gone) within
    the client's grace, not at its timeout; no process is left behind (the teardown's check);
    what the router finished before its death is in its records."""
    import time

    specs, refs = spread_prompts
    t0 = time.monotonic()
    # A grace of 3 s, not 10: what is measured is that it ends them, not how long it waits.
    recs, router, log, run = _run("pdd:relay_s=0", [fault], specs, timeout_s=300, router_grace_s=3.0)
    assert log[0].applied_s is not None and log[0].error is None, log
    assert all(r.done and (r.ok or r.error) for r in recs.values())
    assert time.monotonic() - t0 < 150  # not the 300 s timeout
    failed = {rid: r.error or "" for rid, r in recs.items() if not r.ok}
    assert failed and all(why in e for e in failed.values()), failed
    done = [rid for rid, r in recs.items() if r.ok]
    assert compare([s for s in specs if s.rid in done], refs, {rid: recs[rid] for rid in done}) == []
    if fault.startswith("router"):
        ended_before = {rid for rid in done if (recs[rid].ended or 0) - run.fault_t0 < 1.5}  # host seconds
        assert ended_before <= set(router)


def test_a_wan_outage_past_the_broker_keepalive_makes_the_decoder_unreachable_not_dead(spread_prompts,
                                                                                      tmp_path: Path) -> None:
    """14 s without a line lapses decode-b's broker session (after 7.5-9 s) and its last will goes
    out; the router's probe gets no answer, so decode-b is unreachable, not dead: it keeps
    its requests, which resume when the line is back. No retry: nothing may fail."""
    specs, refs = spread_prompts
    late = RequestSpec("after-the-line", synth_tokens("after-the-line", 200), 8, at=16.5)  # the replay outlasts it
    refs = {**refs, late.rid: ModelRunner(ensure_default_model(), "float64").reference(late.prompt, late.max_new)}
    specs = [*specs, late]
    sc = scenario_with()
    with Deployment(sc, parse_policy("pdd:relay_s=0"), dtype="float64", timeline=[parse_fault("wan-down@1+14")],
                    logs_to=tmp_path) as dep:
        run = dep.run(TraceReplay(specs, timeout_s=120))
    log = (tmp_path / "router.log").read_text()
    assert "worker decode-b is unreachable (no answer)" in log and "worker decode-b is back after" in log, log
    assert "is gone" not in log, log
    assert {rid: r.error for rid, r in run.recs.items() if not r.ok} == {}
    assert compare(specs, refs, run.recs) == []
    assert not any(r.md_failed for r in run.router.values())


def test_a_dead_main_decoder_leaves_the_relay_to_finish_and_new_requests_to_it(spread_prompts) -> None:
    """The client retries (as an agent's SDK does): a request the kill failed is sent again
    and served by the relay alone, so every request ends with the reference tokens."""
    specs, refs = spread_prompts
    kill_at = 1.5
    recs, router, log, run = _run("pdd:relay_s=0", [f"kill@{kill_at}:host=decode-b"], specs,
                                  retry=RetryPolicy(retries=2, initial_s=0.2))
    assert log[0].applied_s is not None
    # Detected (and routed around) within an emulated second, by the router's own record.
    (impact,) = fault_impacts(run, 1.0)
    assert [d.worker for d in run.deaths] == ["decode-b"] and impact.detected_s is not None
    assert 0 < impact.detected_s < 1.0, impact
    assert impact.failed == 0 and impact.goodput_lost == 0.0
    assert {rid: r.error for rid, r in recs.items() if not r.ok} == {}
    assert compare(specs, refs, recs) == []
    retried = {rid: r for rid, r in recs.items() if r.retried}
    for rid, rec in retried.items():
        # Only requests the relay had begun to hand over failed, naming the dead decoder; the
        # retry went to the relay alone.
        for attempt in rec.retried:
            events = router[attempt.rid].events
            assert "decode-b" in attempt.error, attempt
            assert router[attempt.rid].pipeline == "P-RLD-MD" and any(e.kind in ("handoff", "extended")
                                                                     for e in events), (attempt, events)
        assert rec.last_rid == attempt_rid(rid, len(rec.retried)) and router[rec.last_rid].pipeline == "P-RLD"
    rescued = [rid for rid, rec in router.items() if rec.md_failed and recs[rid].ok]
    later = [s.rid for s in specs if s.at > kill_at + 1.0]
    assert later and all(router[rid].pipeline == "P-RLD" for rid in later)
    assert rescued or retried  # the kill landed on requests in flight


def test_without_failure_detection_a_dead_decoder_stays_in_rotation_until_timeouts(spread_prompts) -> None:
    """The PD-outage baseline (``failure_detection: none``): the router ignores the will, so
    decode-b is never declared dead; requests on it end only by their own timeouts, and
    requests sent after the kill are still planned onto it and fail."""
    specs, _ = spread_prompts
    specs = specs[:10]
    kill_at = 1.0
    recs, router, _, run = _run("cross-dc", [f"kill@{kill_at}:host=decode-b"], specs,
                                workers={"failure_detection": "none", "request_timeout_s": 4.0,
                                         "kv_timeout_s": 4.0})
    assert run.deaths == []
    (impact,) = fault_impacts(run, 1.0)
    assert impact.detected_s is None and impact.failed > 0 and impact.recovered_s is not None
    later = [s.rid for s in specs if s.at > kill_at + 0.5]
    assert later and all(router[rid].decode == "decode-b" and not recs[rid].ok for rid in later)
    assert all(r.done for r in recs.values())  # every request ends, by a timeout if nothing else
    for rid in later:
        assert "decode-b" in (recs[rid].error or "") or "timed out" in (recs[rid].error or ""), recs[rid].error


def test_a_dead_relay_after_handoff_affects_nothing(spread_prompts) -> None:
    specs, refs = spread_prompts
    recs, router, _, _ = _run("pdd:relay_s=0", ["kill@2:host=relay"], specs)
    assert all(r.done for r in recs.values())
    for rid, r in recs.items():
        if not r.ok:  # only requests still on the relay (before their handoff) may fail
            assert "relay" in (r.error or "") and not any(e.kind == "extended" for e in router[rid].events), \
                (rid, r.error, [(e.kind, e.worker) for e in router[rid].events])
    handed = [rid for rid, rec in router.items() if any(e.kind == "extended" for e in rec.events)]
    assert handed and all(recs[rid].ok for rid in handed)
    assert compare([s for s in specs if recs[s.rid].ok], refs, recs) == []
    assert all(router[s.rid].pipeline == "P-MD" for s in specs if s.at > 3.0)


@pytest.mark.slow
def test_run_with_faults_accounts_for_every_request_and_saves_the_timeline(tmp_path: Path) -> None:
    """The command of issue #11: faults from the command line, every request accounted for."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session": f"s{i}", "start_s": 0.4 * i, "turns": [
        {"new_tokens": 300, "output_tokens": 64}, {"new_tokens": 20, "output_tokens": 64, "delay_s": 0.2}]}) + "\n"
        for i in range(8)))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "testbed", "run", "--trace", str(trace), "--policies", "pdd",
                          "--token-scale", "4", "--dilation", "1", "--allow-infidelity", "--out", str(out),
                          "--fault", "wan-down@1+1", "--fault", "kill@2:host=relay",
                          # Every component's wall clock an hour back, then decode-b's a day ahead
                          # for a second: no latency may move (they are on the monotonic clock).
                          "--fault", "clock-step@0.5:s=-3600", "--fault", "clock-step@1.5+1:host=decode-b,s=86400"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert "fault wan-down@1+1: applied at" in res.stderr and "fault kill@2:host=relay: applied at" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    applied = summary["policies"]["pdd"]["faults"]
    assert [f["fault"] for f in applied] == ["clock-step@0.5:s=-3600", "wan-down@1+1",
                                             "clock-step@1.5+1:host=decode-b,s=86400", "kill@2:host=relay"]
    assert all(f["applied_s"] is not None and f["error"] is None for f in applied)
    steps = {f["fault"]: f["detail"] for f in applied if f["kind"] == "clock-step"}
    assert all(f"{p} -3600 s" in steps["clock-step@0.5:s=-3600"] for p in ("client", "router", "worker-relay")), steps
    assert "worker-decode-b +82800 s" in steps["clock-step@1.5+1:host=decode-b,s=86400"], steps
    logs = out / "logs" / "pdd"
    assert "wall clock stepped: -3600 s" in (logs / "client.log").read_text()
    assert "wall clock stepped: +82800 s" in (logs / "worker-decode-b.log").read_text()
    assert applied[1]["cleared_s"] == pytest.approx(2.0, abs=0.5)
    # What each fault cost: the killed relay declared dead within an emulated second.
    impact = {m["fault"]: m for m in summary["policies"]["pdd"]["fault_impact"]}
    assert {"wan-down@1+1", "kill@2:host=relay"} <= set(impact)
    assert 0 < impact["kill@2:host=relay"]["detected_s"] < 1.0 and impact["wan-down@1+1"]["detected_s"] is None
    assert "What each fault cost" in (out / "report.md").read_text()
    rows = pd.read_csv(out / "requests.csv")
    assert len(rows) == 16
    done = rows[rows.ok]
    assert len(done) and (done.ttft_s > 0).all() and (done.e2e_s < 120).all(), done[["ttft_s", "e2e_s"]]
    assert (rows.ok | rows.error.astype("string").fillna("").str.len().gt(0)).all()  # completed, or failed: why
    for why in rows.error.dropna():
        assert "(during fault" in why or why.startswith("not sent: previous turn"), why
    # Retried by default (two retries, as the OpenAI SDK): each retried attempt says why it failed.
    retried = rows[rows.attempts > 1]
    assert (rows.attempts <= 3).all()
    assert (retried.retried_errors.astype("string").str.count(" \\| ") == retried.attempts - 2).all()
    assert summary["policies"]["pdd"]["failed_attempts"] == int((rows.attempts - 1).sum())
