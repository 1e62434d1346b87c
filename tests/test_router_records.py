"""The router keeps only its latest finished requests in memory: older records go to the
records file as they leave, so a long run's memory stays flat and nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from control.ended import ENDED_KEEP_S, ENDED_KEPT, Ended
from control.router import Router
from protocol.messages import Failed, KvSent, PrefillDone, Request
from protocol.router_config import RequestRecord, RouterConfig, WorkerEndpoint
from protocol.worker_config import BrokerInfo
from testbed.deploy.cluster import ROUTER_ENV
from testbed.policies import RequestState, parse_policy
from testbed.policies.base import PolicyContext, WorkerView
from testbed.policies.prefix_index import PrefixIndex

ROOT = Path(__file__).resolve().parent.parent


def test_finished_records_stream_to_disk_and_memory_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    cfg = RouterConfig(run_id="t1", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("same-dc"), records_path=str(path),
                       workers={"decode-a": WorkerEndpoint(role="decode", dc="a", host="10.0.0.2", kv_port=7070)})
    router = Router(cfg)
    n = ENDED_KEPT + 904
    with path.open("w") as router.ended.file:
        for i in range(n):
            router._finish(RequestState(f"r{i}", [1, 2, 3], 4, 0.0), None if i % 7 else "worker decode-a died")
            assert len(router.ended.records) <= ENDED_KEPT and len(router.ended.states) <= ENDED_KEPT
        on_disk = path.read_text().splitlines()
        assert len(on_disk) == n  # written as they ended (a router killed loses none), not at the end
        router.ended.write_all()  # nothing came late: nothing written again
    recs = [RequestRecord.model_validate_json(line) for line in path.read_text().splitlines()]
    assert [r.rid for r in recs] == [f"r{i}" for i in range(n)]  # each once, in order
    assert recs[7].error == "worker decode-a died" and recs[8].error is None


def test_finished_requests_leave_memory_once_older_than_the_late_event_window(tmp_path: Path,
                                                                             monkeypatch) -> None:  # noqa: ANN001
    """Late events come within seconds: what ended more than ENDED_KEEP_S (emulated) ago is on
    disk only, however few requests that is, so a long run's router stays flat."""
    from protocol import clock as clocks

    path = tmp_path / "records.jsonl"
    cfg = RouterConfig(run_id="t2", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("same-dc"), records_path=str(path), dilation=2.0,
                       workers={"decode-a": WorkerEndpoint(role="decode", dc="a", host="10.0.0.2", kv_port=7070)})
    router = Router(cfg)
    clock = [100.0]
    monkeypatch.setattr(clocks, "monotonic", lambda: clock[0])
    with path.open("w") as router.ended.file:
        for i in range(10):
            router._finish(RequestState(f"r{i}", list(range(1000)), 4, 0.0), None)
        clock[0] += ENDED_KEEP_S * 2.0 - 1  # inside the window (x D)
        router._finish(RequestState("r10", [1], 4, 0.0), None)
        assert len(router.ended.states) == 11 and len(path.read_text().splitlines()) == 11
        clock[0] += 2
        router._finish(RequestState("r11", [1], 4, 0.0), None)
        assert set(router.ended.states) == set(router.ended.records) == set(router.ended.at) == {"r10", "r11"}
        assert [RequestRecord.model_validate_json(x).rid for x in path.read_text().splitlines()] == [
            f"r{i}" for i in range(12)]  # each once: none came late


def _drive_a_burst(folder: str) -> None:
    """A router given steady requests, then 150 at once, then steady ones again: prints its
    memory floor (RSS net of its indexes, after a trim) before and after the burst."""
    import asyncio
    import random

    from protocol.messages import Done, Request
    from workers.allocator import WATCH, rss_bytes

    cfg = RouterConfig(run_id="t3", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("pdd"), records_path=f"{folder}/records.jsonl", dilation=1e-6,
                       workers={"prefill": WorkerEndpoint(role="prefill", dc="a", host="10.0.0.2", kv_port=7070),
                                "relay": WorkerEndpoint(role="relay-decode", dc="a", host="10.0.0.3", kv_port=7070),
                                "decode-b": WorkerEndpoint(role="decode", dc="b", host="10.0.0.4", kv_port=7070)})
    router = Router(cfg)
    rng = random.Random(1)
    prompts = [[rng.randrange(300, 32000) for _ in range(9000)] for _ in range(20)]

    async def publish(topic: str, payload: bytes, retain: bool = False) -> None:
        pass

    async def requests(k: int, start: int) -> None:
        for i in range(start, start + k):
            req = Request(rid=f"r{i}", prompt=prompts[i % 20][: 2000 + i * 300 % 7000], max_new=100)
            await router._admit(Request.model_validate_json(req.model_dump_json()))
        for i in range(start, start + k):
            st = router.inflight[f"r{i}"]
            assert st.plan is not None
            relay = st.plan.relay
            await router._on_event(Done(rid=f"r{i}", worker=relay or st.plan.decode, t=0.0, output_tokens=100,
                                        handed_off=False if relay else None))

    def floor() -> float:
        WATCH.trim()
        return (rss_bytes() - WATCH.held_bytes()) / 2**20

    async def main() -> None:
        router.publish = publish  # type: ignore[method-assign]
        for w in router.view.workers.values():
            w.up = True
        for i in range(0, 120, 2):
            await requests(2, i)
        before = floor()
        await requests(150, 1000)
        for i in range(2000, 2120, 2):
            await requests(2, i)
        print(json.dumps({"before": before, "after": floor()}))

    with open(cfg.records_path, "w") as router.ended.file:
        asyncio.run(main())


def test_a_burst_of_requests_leaves_the_routers_memory_floor_where_it_was(tmp_path: Path) -> None:
    """The router runs on the C allocator (``ROUTER_ENV``) so that memory a burst of prompts
    took goes back: on Python's arenas this burst raised the floor by ~30 MB, for good."""
    script = f"from tests.test_router_records import _drive_a_burst; _drive_a_burst({str(tmp_path)!r})"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **ROUTER_ENV}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    floors = json.loads(out.splitlines()[-1])
    assert floors["after"] - floors["before"] < 6, floors


def test_the_router_holds_a_requests_tokens_compactly_and_counts_them() -> None:
    """The router's memory floor leaves out the requests it holds (a window of prompts, which
    grows with a session's context): what a request keeps once its message is gone is its
    token arrays, 4 bytes an id, and what it says it holds is within 10 % of that (as lists
    of ints it kept ~10x more, most of it uncounted on the router's allocator)."""
    toks = [300 + (7919 * i) % 30000 for i in range(4096)]
    raw = json.dumps({"rid": "c0-s0000.0", "prompt": toks, "max_new": 10, "hints": {"answer": toks[:100]}})
    # Once before measuring: what the first parse in a process builds and keeps (validator and
    # interning caches; 2 KB when this test ran first on its worker) belongs to no request.
    warm = Request.model_validate_json(raw)
    RequestState(warm.rid, warm.prompt, warm.max_new, 0.0, warm.hints)
    del warm
    # Eight requests, their mean compared: tracemalloc counts every thread, and the test
    # runner's own I/O thread allocated ~2 KB inside one request's window (CI, under xdist).
    n = 8
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        held = []
        for _ in range(n):
            r = Request.model_validate_json(raw)
            held.append(RequestState(r.rid, r.prompt, r.max_new, 0.0, r.hints))
            del r
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    mine = [tracemalloc.Filter(False, "*execnet*"), tracemalloc.Filter(False, tracemalloc.__file__)]
    kept = sum(s.size_diff for s in after.filter_traces(mine).compare_to(before.filter_traces(mine), "filename")) / n
    req = held[0]
    assert all(q.nbytes == req.nbytes for q in held)
    assert abs(req.nbytes - kept) <= 0.1 * kept and req.nbytes < 5 * (4096 + 100)
    assert req.prompt.tolist() == toks and req.answer.tolist() == toks[:100] and req.hints.answer is None
    index = PrefixIndex(16, 1 << 20)
    index.insert(req.prompt)  # the router indexes the array; a policy may ask with the message's list
    assert index.match(toks) == 4096 and index.match(toks[:100] + [1] * 60) == 96


async def _admitted(router: Router, sent: list[str], req: Request) -> Any:
    """``req`` admitted by a router whose workers are all up and whose publications land in
    ``sent`` (their topics); returns its plan."""
    async def publish(topic: str, payload: bytes, retain: bool = False) -> None:
        sent.append(topic)

    router.publish = publish  # type: ignore[method-assign]
    for w in router.view.workers.values():
        w.up = True
    await router._admit(req)
    plan = router.inflight[req.rid].plan
    assert plan is not None
    return plan


def test_a_repeated_event_is_acted_on_and_counted_once(tmp_path: Path) -> None:
    """After a broker restart QoS 1 may deliver a worker's event twice: the router hands off
    once, records one transfer (its WAN bytes once) and drops the repeat, also after the end."""
    import asyncio

    from protocol.messages import Done, KvReceived

    cfg = RouterConfig(run_id="t4", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("pdd:relay_s=0"), records_path=str(tmp_path / "records.jsonl"),
                       context=PolicyContext(wan_rate_bps=1e9, wan_rtt_s=0.03, kv_bytes_per_token=4096, home_dc="a"),
                       workers={"prefill": WorkerEndpoint(role="prefill", dc="a", host="10.0.0.2", kv_port=7070),
                                "relay": WorkerEndpoint(role="relay-decode", dc="a", host="10.0.0.3", kv_port=7070),
                                "decode-b": WorkerEndpoint(role="decode", dc="b", host="10.0.0.4", kv_port=7070)})
    router = Router(cfg)
    sent: list[str] = []

    async def main() -> None:
        plan = await _admitted(router, sent, Request(rid="r1", prompt=list(range(5000)), max_new=50))
        assert plan.relay == "relay" and plan.decode == "decode-b"
        kv = KvSent(rid="r1", worker="prefill", t=1.0, to="decode-b", bytes=10_000, written=10_000, payload=9_000,
                    planned_payload=9_000, tokens=5000, had=0, start=0.5, end=1.0)
        got = KvReceived(rid="r1", worker="decode-b", t=1.1, bytes=10_000, had=0, start=0.5, end=1.05)
        before = len(sent)
        for ev in (kv, got, kv, got):
            await router._on_event(KvSent.model_validate_json(ev.model_dump_json()) if ev is kv else
                                   KvReceived.model_validate_json(ev.model_dump_json()))
        assert sent[before:] == [router.topics.cmd("relay")]  # one handoff
        assert [e.kind for e in router.inflight["r1"].events] == ["kv_sent", "kv_received"]
        done = Done(rid="r1", worker="decode-b", t=2.0, output_tokens=50)
        await router._on_event(done)
        await router._on_event(Done.model_validate_json(done.model_dump_json()))  # after the end
        assert [e.kind for e in router.ended.records["r1"].events] == ["kv_sent", "kv_received", "done"]
        # A later event of the same kind from the same worker is not a repeat.
        await router._on_event(kv.model_copy(update={"t": 3.0}))
        assert [e.kind for e in router.ended.records["r1"].events].count("kv_sent") == 2

    with open(cfg.records_path, "w") as router.ended.file:
        asyncio.run(main())
    assert router.repeated_events == 3


@pytest.mark.hostile
def test_a_worker_speaks_only_for_itself_and_for_requests_it_was_given(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Who sent a status or an event is its topic's worker: relay's status naming decode-b,
    prefill's event signed decode-b, and an event for a request by a worker outside its plan
    are refused and logged; the request and decode-b are untouched."""
    import asyncio
    from types import SimpleNamespace

    from protocol.messages import Done, Status

    cfg = RouterConfig(run_id="t5", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("cross-dc"), records_path=str(tmp_path / "records.jsonl"),
                       workers={"prefill": WorkerEndpoint(role="prefill", dc="a", host="10.0.0.2", kv_port=7070),
                                "decode-a": WorkerEndpoint(role="decode", dc="a", host="10.0.0.3", kv_port=7070),
                                "decode-b": WorkerEndpoint(role="decode", dc="b", host="10.0.0.4", kv_port=7070)})
    router = Router(cfg)
    t = router.topics

    def msg(topic: str, body: object) -> SimpleNamespace:
        return SimpleNamespace(topic=topic, payload=body.dump())  # type: ignore[attr-defined]

    async def main() -> None:
        plan = await _admitted(router, [], Request(rid="r1", prompt=list(range(100)), max_new=5))
        assert plan.decode == "decode-b"
        dead = Status(worker="decode-b", role="decode", state="dead")
        await router._on_message(msg(t.status("decode-a"), dead))  # decode-a declaring decode-b dead
        fail = Failed(rid="r1", worker="decode-b", t=1.0, reason="forged")
        await router._on_message(msg(t.events("prefill"), fail))  # prefill signing as decode-b
        await router._on_message(msg(t.events("decode-a"), Failed(rid="r1", worker="decode-a", t=1.0,
                                                                  reason="not mine")))  # not in r1's plan
        assert "r1" in router.inflight and router.inflight["r1"].events == []
        assert router.view.workers["decode-b"].up and not router.liveness.suspects
        await router._on_message(msg(t.events("decode-b"), Done(rid="r1", worker="decode-b", t=2.0,
                                                                 output_tokens=5)))
        assert "r1" not in router.inflight  # its own worker is heard

    with open(cfg.records_path, "w") as router.ended.file:
        asyncio.run(main())
    log = capsys.readouterr().err
    assert f"refused a message on {t.status('decode-a')} claiming to be 'decode-b'" in log
    assert f"refused a message on {t.events('prefill')} claiming to be 'decode-b' (for r1)" in log
    assert "refused a failed of r1 from decode-a, not a worker of its plan" in log


def test_a_stopping_router_waits_for_kv_still_on_its_way_to_a_main_decoder(tmp_path: Path) -> None:
    """PDD's transfer to the main decoder may outlive its request (kept for the decoder's
    cache, or cut off): until its sender reports it, its WAN bytes are missing from the
    record, so the router's stop waits for it (while its prefill is up)."""
    ended = Ended(dilation=1.0)
    workers = {n: WorkerView(n, r, dc, "10.0.0.9", 7070, up=True)
               for n, r, dc in (("prefill", "prefill", "a"), ("relay", "decode", "a"), ("decode-b", "decode", "b"))}
    done = PrefillDone(rid="r1", worker="prefill", t=1.0, hit_tokens=0, computed=100, first_token=5, start=0.5,
                       end=1.0, real_s=0.5)
    rec = RequestRecord(rid="r1", pipeline="P-RLD-MD", prefill="prefill", decode="decode-b", relay="relay",
                        events=[done])
    ended.add(RequestState("r1", [1, 2, 3], 4, 0.0), rec)
    assert ended.kv_on_its_way(workers)
    plain = Ended(dilation=1.0)
    plain.add(RequestState("r2", [1, 2, 3], 4, 0.0), rec.model_copy(update={"rid": "r2", "relay": None}))
    assert not plain.kv_on_its_way(workers)  # no relay: its decoder had the KV before it decoded
    for gone in ("prefill", "decode-b"):  # a dead end: the transfer is lost, not on its way
        workers[gone].up = False
        assert not ended.kv_on_its_way(workers)
        workers[gone].up = True
    failed = rec.model_copy(update={"events": [done, Failed(rid="r1", worker="prefill", t=2.0, reason="reset",
                                                           target="decode-b")]})
    broken = Ended(dilation=1.0)
    broken.add(RequestState("r3", [1, 2, 3], 4, 0.0), failed.model_copy(update={"rid": "r3"}))
    assert not broken.kv_on_its_way(workers)  # its transfer failed: the prefill said so
    rec.events.append(KvSent(rid="r1", worker="prefill", t=3.0, to="relay", bytes=10, written=10, payload=8,
                             planned_payload=8, tokens=1, had=0, start=1.0, end=1.1))
    assert ended.kv_on_its_way(workers)  # the relay's KV is not the main decoder's
    rec.events.append(KvSent(rid="r1", worker="prefill", t=4.0, to="decode-b", bytes=10, written=20, payload=8,
                             planned_payload=16, tokens=1, had=0, start=1.0, end=4.0, cancelled=True, in_flight=10))
    assert not ended.kv_on_its_way(workers)


def test_a_record_the_disk_refuses_is_kept_and_written_once_it_takes_it() -> None:
    """A full tmpfs: the router's records file refuses a write; the record stays in memory
    (it was popped before it was written, and lost), the next write starts a fresh line, and
    every record reaches the file once the disk takes them again."""
    import io

    from protocol.router_config import RequestRecord

    class Full(io.StringIO):
        refuse = True

        def write(self, s: str) -> int:
            if self.refuse:
                super().write(s[:7])  # half a line, then the error
                raise OSError(28, "No space left on device")
            return super().write(s)

    ended = Ended(1.0)
    ended.file = Full()
    for i in range(3):
        ended.records[f"r{i}"] = RequestRecord(rid=f"r{i}")
        ended.at[f"r{i}"] = 0.0
    ended.write_all()
    assert list(ended.records) == ["r0", "r1", "r2"]  # nothing dropped
    ended.file.refuse = False
    ended.write_all()
    lines = ended.file.getvalue().splitlines()
    assert [RequestRecord.model_validate_json(x).rid for x in lines[1:]] == ["r0", "r1", "r2"] and not ended.records
