"""``testbed soak``: its workload and fault schedule (no root), and a short soak end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.deploy.run_record import ClientRecord
from testbed.faults.timeline import AppliedFault
from testbed.load.retry import SOAK_RETRY
from testbed.load.soak import NO_FAULT, costly_faults, random_faults, soak_specs
from testbed.scenario import load_scenario
from testbed.traces import load_trace
from testbed.traces.workload import RequestSpec

from .conftest import ROOT, TOPOLOGIES, host_state, left_behind, needs_root


def test_the_trace_repeats_back_to_back_with_whole_sessions() -> None:
    wl = load_trace(ROOT / "traces" / "agentic-quick.jsonl", "auto", 16)
    specs = soak_specs(wl, wall_s=120.0, load=1.5, dilation=2.0)
    rids = [s.rid for s in specs]
    assert len(rids) == len(set(rids))
    assert {r.split("-", 1)[0] for r in rids} >= {"c0", "c1", "c2"}
    roots = [s for s in specs if s.after is None]
    assert max(s.at for s in roots) < 120.0
    kept = set(rids)
    assert all(s.after in kept for s in specs if s.after is not None)  # no turn without its session
    # Each copy is the trace at 1.5x its rate, stretched by the dilation, one span after the last.
    base = sorted(s.at for s in wl.specs(1.5 / 2.0) if s.after is None)
    span = base[-1] + 1.0
    for k in (0, 1):
        copy = sorted(s.at for s in roots if s.rid.startswith(f"c{k}-"))
        assert copy == pytest.approx([t + k * span for t in base])


def test_random_faults_cover_every_kind_and_fit_the_scenario() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    # Times are emulated seconds, whatever the dilation: the emulated system meets the same rate.
    faults = random_faults(sc, emulated_s=3600, every_s=60, seed=4)
    assert len(faults) == 59
    assert {f.kind for f in faults} == {"wan-down", "loss", "delay", "rate", "partition", "kill", "broker-restart"}
    assert [f.at_s for f in faults] == pytest.approx([60 * (k + 1) for k in range(59)], abs=0.01)
    for f in faults:
        sc.check_fault(f)  # names the scenario's datacenters, workers, shaped directions
        assert f.duration_s is not None  # a killed worker comes back: the cluster lives on
    assert random_faults(sc, 3600, 60, seed=4) == faults  # seeded
    downs = {f.duration_s for f in faults if f.kind == "wan-down"}
    assert max(downs) == 30 and downs <= {4, 8, 15, 30}, downs  # the line's outages last up to 30 s


def test_a_soak_fails_when_nothing_completes_after_the_faults() -> None:
    from testbed.load.soak import SoakReport

    base = {"minutes": 1, "load": 1, "policy": "pdd", "dilation": 2, "requests": 10, "completed": 5, "failed": 5,
            "hung": 0, "lost": 0, "failures_by_reason": {}, "faults": [], "faults_by_kind": {}, "memory": []}
    assert SoakReport(**base).passed  # no request after the faults: nothing to say
    assert SoakReport(**base, after_faults_sent=4, after_faults_completed=3).passed
    assert not SoakReport(**base, after_faults_sent=4, after_faults_completed=0).passed
    assert not SoakReport(**{**base, "hung": 1}).passed


def test_a_soak_fails_when_a_long_lived_process_grows() -> None:
    from testbed.deploy.process_sampling import ProcessMemory
    from testbed.load.soak import SoakReport

    # 5 emulated minutes at D 2: 600 wall s, half of it 300 s.
    base = {"minutes": 5, "load": 1, "policy": "pdd", "dilation": 2, "requests": 10, "completed": 10,
            "failed": 0, "hung": 0, "lost": 0, "failures_by_reason": {}, "faults": [], "faults_by_kind": {}}

    def proc(first: float, mid: float, last: float, lived_s: float) -> ProcessMemory:
        return ProcessMemory(name="router", pid=7, samples=100, rss_first_mb=first, rss_peak_mb=max(first, last),
                             rss_last_mb=last, settled_s=lived_s, rss_mid_mb=mid)

    assert SoakReport(**base, memory=[proc(100, 104, 109, 540)]).passed  # +5 % in the second half
    assert not SoakReport(**base, memory=[proc(100, 105, 118, 540)]).passed  # +12 %: still growing
    assert SoakReport(**base, memory=[proc(100, 400, 405, 540)]).passed  # a cache filled, then flat
    assert SoakReport(**base, memory=[proc(100, 150, 300, 120)]).passed  # a worker restarted late: too young
    assert SoakReport(**base, memory=[proc(5, 5, 6.5, 540)]).passed  # +1.5 MB: page noise of a small process


def test_a_worker_is_judged_on_its_floor_net_of_caches() -> None:
    """A relay whose RSS doubled in its second half while its cache filled and its work came
    and went passes when its floor net of the cache stayed; a floor that climbs fails."""
    from testbed.deploy.process_sampling import ProcessMemory, with_floor

    relay = ProcessMemory(name="worker-relay", pid=9, samples=900, rss_first_mb=700, rss_peak_mb=1600,
                          rss_last_mb=1550, settled_s=1800, rss_mid_mb=750)
    assert not relay.flat()  # on RSS alone: +107 %
    mb = 2**20
    start = 1_000_000.0
    steady = [(start + 60 * i, (330 + (i % 3)) * mb) for i in range(30)]  # the quietest moment each minute
    judged = with_floor(relay, steady)
    assert judged.judged_on_floor and judged.flat() and abs(judged.late_growth_mb) < 3
    leaking = [(start + 60 * i, (330 + 4 * i) * mb) for i in range(30)]  # +4 MB a minute
    judged = with_floor(relay, leaking)
    assert not judged.flat() and judged.late_growth_mb > 50
    assert with_floor(relay, steady[:4]) == relay  # under 4 settled minutes: RSS decides


@pytest.mark.slow
@needs_root
def test_a_short_soak_ends_every_request_and_samples_memory(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    # Short two-turn sessions: the soak ends soon after its last fault, every request drained
    # (the shipped trace's long sessions kept it draining for 100 s after 24 s of faults).
    trace = tmp_path / "short-sessions.jsonl"
    trace.write_text("".join(json.dumps({
        "session": f"s{i}", "start_s": 1.2 * i, "shared_prefix": {"id": f"tools-{i % 2}", "tokens": 1500},
        "turns": [{"new_tokens": 300, "output_tokens": 48},
                  {"new_tokens": 100, "output_tokens": 48, "delay_s": 0.5}]}) + "\n" for i in range(10)))
    before = host_state()
    # Seed 6: a broker restart, a rate and a loss fault. Not a WAN outage: one that TCP's
    # backoff stretches past the broker keepalive still marks a live worker dead (open).
    # 12 emulated s (18 s of wall clock at D 1.5), a fault every 3.5 emulated s.
    res = subprocess.run([sys.executable, "-m", "testbed", "soak", "--trace", str(trace), "--minutes", "0.2",
                          "--fault-every", "3.5",
                          "--token-scale", "16", "--dilation", "1.5", "--seed", "6", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["hung"] == 0 and report["lost"] == 0
    # The cluster serves again once the faults are over (restarted workers included).
    assert report["after_faults_sent"] == 0 or report["after_faults_completed"] > 0, report
    assert report["completed"] + report["failed"] == report["requests"] > 0
    assert sum(report["faults_by_kind"].values()) >= 3
    assert report["fault_every_s"] == 3.5 and "(17 per emulated minute)" in res.stdout
    assert sorted(f["at_s"] for f in report["faults"]) == pytest.approx([3.5, 7.0, 10.5])  # emulated s, not wall
    names = {m["name"] for m in report["memory"]}
    assert {"router", "mosquitto", "worker-prefill", "worker-decode-b", "orchestrator"} <= names
    assert all((out / f).stat().st_size > 0 for f in ("requests.csv", "rss.csv", "rss.png"))
    assert "hung 0, lost 0" in res.stdout
    # Nothing left behind, the restarted broker included.
    assert not left_behind(before)
    pids = {m["pid"] for m in report["memory"] if m["name"] != "orchestrator"}
    assert pids and not [pid for pid in pids if _ours_alive(pid)]


def _ours_alive(pid: int) -> bool:
    """A process of the run still running (not a zombie being reaped, not a reused pid)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and any(k in cmdline for k in (b"workers", b"mosquitto", b"testbed"))


def test_the_soaks_retries_outwait_a_killed_worker_and_each_failure_names_its_fault() -> None:
    """A request whose only worker of a role was killed is sent again after the worker is back
    (down up to 8 s, then started): the soak's waits add up to more, at their shortest; and each
    request that failed anyway is charged to the fault in effect while it lived, a later turn of
    its session to the same fault."""
    shortest = sum(min(SOAK_RETRY.initial_s * 2**k, SOAK_RETRY.max_s) * (1 - SOAK_RETRY.jitter)
                   for k in range(SOAK_RETRY.retries))
    kills = [f for f in random_faults(load_scenario(TOPOLOGIES / "two-dc.yaml"), 3600, 60, seed=4) if f.kind == "kill"]
    assert kills and shortest >= max(f.duration_s or 0 for f in kills) + 3, shortest  # + a worker's start
    kill = AppliedFault(fault="kill@10+8:host=prefill", kind="kill", at_s=10, applied_s=10.0, cleared_s=18.0)
    t0, d = 100.0, 2.0  # the fault clock's zero on the client's clock; the dilation
    recs = {rid: ClientRecord(rid, 10, 4, sent=t0 + d * sent, ended=t0 + d * end, error=why, done=True)
            for rid, sent, end, why in [("a.0", 9, 12, "prefill down"), ("a.1", 0, 0, "previous turn failed"),
                                        ("b.0", 30, 31, "bad luck"), ("c.0", 11, 14, None)]}
    recs["a.1"].sent = 0.0  # never sent: its session ended with a.0
    specs = [RequestSpec("a.0", [1], 4), RequestSpec("a.1", [1], 4, after="a.0"), RequestSpec("b.0", [1], 4),
             RequestSpec("c.0", [1], 4)]
    cost = costly_faults(recs, specs, [kill], t0, d)
    assert cost == {"a.0": "kill@10+8:host=prefill", "a.1": "kill@10+8:host=prefill", "b.0": NO_FAULT}
