"""KV on the WAN as it crossed the line: the delay line's and the link model's counters, the
check that no bin exceeds the line, and the sum that matches the table."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.analysis.results import load_run
from testbed.analysis.wan_line import byte_factor, disagreements, in_flight_max, kv_total, line_of, overruns
from testbed.deploy.run_record import LineBins
from testbed.net.line_tap import KV_BIN_S, KvTap, tcp_payload
from testbed.sim.links import spread

from .conftest import ROOT, needs_root, run_cli

TRACE = ROOT / "traces" / "agentic-quick.jsonl"


def _frame(sport: int, dport: int, payload: int, proto: int = 6, ethertype: bytes = b"\x08\x00", seq: int = 0) -> bytes:
    ip = bytes([0x45, 0]) + struct.pack("!H", 20 + 32 + payload) + bytes(5) + bytes([proto]) + bytes(10)
    tcp = struct.pack("!HHI", sport, dport, seq % (1 << 32)) + bytes(4) + bytes([0x80]) + bytes(19)  # 32-byte header
    return bytes(12) + ethertype + ip + tcp + b"x" * payload


def test_the_delay_line_counts_tcp_payload_of_kv_connections_only() -> None:
    kv = frozenset({7070})
    assert tcp_payload(_frame(40000, 7070, 1200), kv) == 1200  # to a KV listener
    assert tcp_payload(_frame(7070, 40000, 9), kv) == 9  # its replies
    assert tcp_payload(_frame(40000, 7070, 0), kv) == 0  # a bare ACK
    assert tcp_payload(_frame(40000, 1883, 500), kv) == 0  # the broker's traffic is not KV
    assert tcp_payload(_frame(40000, 7070, 500, proto=17), kv) == 0
    assert tcp_payload(_frame(40000, 7070, 500, ethertype=b"\x08\x06"), kv) == 0
    assert tcp_payload(_frame(40000, 7070, 500)[:40], kv) == 0  # too short to hold the headers


def test_bytes_that_cross_again_are_counted_apart() -> None:
    tap = KvTap(socket.socket(), frozenset({7070}), t0=100.0)  # counts frames given to it; reads nothing
    start = (1 << 32) - 1000  # the sequence numbers wrap during the transfer
    tap.count(_frame(40000, 7070, 0, seq=start - 1), 100.0)  # the SYN
    for k in range(3):
        tap.count(_frame(40000, 7070, 1000, seq=(start + 1000 * k) % (1 << 32)), 100.001 + 0.02 * k)
    tap.count(_frame(40000, 7070, 1000, seq=start + 1000), 100.11)  # a retransmission
    tap.count(_frame(40000, 7070, 1500, seq=start + 2500), 100.11)  # a third old, two thirds new
    tap.count(_frame(40001, 7070, 700, seq=start), 100.11)  # another connection
    # Out of order (frames do cross so): a segment ahead, then the one before it, then both again.
    tap.count(_frame(40000, 7070, 500, seq=start + 4500), 100.11)
    tap.count(_frame(40000, 7070, 500, seq=start + 4000), 100.11)
    tap.count(_frame(40000, 7070, 1000, seq=start + 4000), 100.11)
    assert tap.bins.tolist() == [1000, 1000, 1000, 0, 0, 2700] and tap.resent == 2500


def test_bytes_moved_at_a_constant_rate_are_binned_by_when_they_moved() -> None:
    bins: list[float] = []
    spread(bins, 0.5 * KV_BIN_S, 2.5 * KV_BIN_S, 1000.0)
    assert bins == pytest.approx([250.0, 500.0, 250.0])
    spread(bins, 2.5 * KV_BIN_S, 2.5 * KV_BIN_S, 7.0)  # an instant: all in its bin
    assert sum(bins) == pytest.approx(1007.0) and bins[2] == pytest.approx(257.0)
    # Fine bins summed in neighbours, in emulated seconds from the first request.
    line = line_of(LineBins(t0=100.0, bin_s=0.02, bytes=[1] * 1500 + [0] * 10), t0=101.0, dilation=2.0)
    assert line.start_s == pytest.approx(-0.5) and line.bin_s == pytest.approx(0.03) and sum(line.wire_bytes) == 1500
    assert len(line.wire_bytes) <= 600


def test_a_simulated_run_counts_kv_as_it_crosses_and_never_above_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["run", "--engine", "sim", "--trace", str(TRACE), "--token-scale", "16", "--limit", "40",
                         "--policies", "cross-dc,pdd", "--out", str(out)], capsys)
    assert code == 0, err
    summary, _ = load_run(out)
    for name in ("cross-dc", "pdd"):
        s = summary.policies[name]
        assert s.wan_kv_bytes > 0 and kv_total(s) == pytest.approx(s.wan_kv_bytes, rel=0.01)
        assert sum(s.wan_line["a->b"].wire_bytes) > 0.99 * kv_total(s)  # KV goes a->b
    assert disagreements(summary) == []
    # The check can fail: a bin at twice the line's rate is named.
    s = summary.policies["cross-dc"]
    line = s.wan_line["a->b"]
    rate = summary.scenario.wan.forward.rate_mbit * 1e6 / 8
    fast = line.model_copy(update={"wire_bytes": [*line.wire_bytes[:5],
                                                  int(2 * rate * line.bin_s / byte_factor(summary)) + 10**6]})
    bad = summary.model_copy(update={"policies": {"cross-dc": s.model_copy(update={"wan_line": {"a->b": fast}})}})
    assert any("cross-dc a->b" in p and "above the line" in p for p in overruns(bad))
    # The sum: a transfer cut off (PDD's handoff) crossed what it had in flight beyond what the
    # table counts (the acknowledged), at most what it wrote unacknowledged; more is named.
    # A summary written before senders kept that allows in_flight_max a cut-off.
    p = summary.policies["pdd"]
    room = in_flight_max(summary)
    assert 0 < room < 0.2 * p.wan_kv_bytes
    # What the run's own cut-offs crossed beyond the table (their windows in flight) is taken
    # out of what is added: each case's line then exceeds the table by exactly its own amount.
    crossed = kv_total(p) - p.wan_kv_bytes
    for cut, in_flight, extra, named in ((0, 0, 0.5, True), (2, None, 1.5, False), (2, None, 2.5, True),
                                       (2, int(3 * room), 2.5, False), (2, int(room), 1.5, True)):
        line = p.wan_line["a->b"]
        added = int(0.01 * p.wan_kv_bytes + extra * room) - crossed  # past the 1 % every run may differ by
        more = line.model_copy(update={"wire_bytes": [*line.wire_bytes, added]})
        q = p.model_copy(update={"wan_cut_offs": cut, "wan_kv_in_flight_bytes": in_flight,
                                 "wan_line": {**p.wan_line, "a->b": more}})
        wrong = disagreements(summary.model_copy(update={"policies": {"pdd": q}}))
        assert any("the line counted" in w for w in wrong) == named, (cut, in_flight, extra, wrong)


@needs_root
@pytest.mark.slow
def test_the_delay_line_counts_what_the_table_says_crossed_and_never_above_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session": f"s{i}", "start_s": 0.3 * i, "turns": [
        {"new_tokens": 3000, "output_tokens": 40}]}) + "\n" for i in range(6)))
    out = tmp_path / "run"
    code, err = run_cli(["run", "--scenario", str(ROOT / "topologies" / "two-dc-modeled.yaml"), "--trace", str(trace),
                         "--token-scale", "16", "--policies", "cross-dc", "--dilation", "2", "--allow-infidelity",
                         "--out", str(out)], capsys)
    assert code == 0, err
    summary, _ = load_run(out)
    s = summary.policies["cross-dc"]
    forward = sum(s.wan_line["a->b"].wire_bytes)
    assert s.wan_kv_bytes > 0 and forward == pytest.approx(s.wan_kv_bytes, rel=0.01)  # the same bytes, counted twice
    assert 0 < sum(s.wan_line["b->a"].wire_bytes) < 0.01 * forward  # the receivers' replies
    assert disagreements(summary) == []


def test_a_taps_bins_cost_eight_bytes_each_for_the_whole_run() -> None:
    """A soak's delay line keeps every 20 ms bin of its run (135,000 in 45 minutes): held as a
    list they cost a pointer and, for every busy bin, an int object; now 8 bytes each."""
    import tracemalloc

    tap = KvTap(socket.socket(), frozenset({7070}), t0=0.0)
    frames = [_frame(40000, 7070, 1000 + i % 200, seq=i * 1200) for i in range(20_000)]
    tap.count(frames[0], 0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i, f in enumerate(frames[1:], 1):  # a busy bin every fifth: 100,000 bins
            tap.count(f, 5 * i * KV_BIN_S + 0.001)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
        tap.sock.close()
    assert len(tap.bins) >= 99_990 and grown <= 9 * len(tap.bins), grown


def test_a_tap_forgets_connections_idle_for_two_minutes() -> None:
    """A soak opens KV connections after every fault; the tap's state for each was kept for the
    whole run. An idle one is forgotten, and counted afresh (no byte twice) if it speaks again."""
    tap = KvTap(socket.socket(), frozenset({7070}), t0=0.0)
    for k in range(500):  # one connection a second, one segment each
        tap.count(_frame(20000 + k, 7070, 1000, seq=1000), float(k))
    assert len(tap._seen) <= 1 + KvTap.IDLE_FORGET_S * 1.25
    tap.count(_frame(20000, 7070, 1000, seq=2000), 600.0)  # the first connection, after its idle time
    tap.count(_frame(20499, 7070, 1000, seq=1000), 600.0)  # the last one's segment again: a retransmission
    assert sum(tap.bins) == 501 * 1000 and tap.resent == 1000


def test_the_delay_lines_statistics_writes_leave_no_garbage_for_a_collector_it_has_off(tmp_path: Path) -> None:
    """The delay line runs with the garbage collector off (no pauses in its forwarding loop),
    so anything it does every second must free itself by reference counting: written with
    json.dump, each statistics file left a cycle of the encoder's nested functions behind
    (the line's RSS crept 0.24 MB a minute over a 45-minute soak)."""
    path = tmp_path / "stats.json"
    # In a process of its own, as the line runs: this one's other threads (a test's Ray
    # client, say) make garbage of their own while the collector is off.
    probe = ("import gc, sys, time\n"
             "from testbed.net.delayline import write_stats\n"
             "gc.collect(); gc.disable()\n"
             "for _ in range(50): write_stats(sys.argv[1], [], time.monotonic(), final=False)\n"
             "print(gc.collect())\n")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == 0, out
    assert json.loads(path.read_text())["final"] is False
