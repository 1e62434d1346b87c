"""Every shape that crosses a process: round trips, rejections, and a bad message on a live
cluster failing only the request it names."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
from typing import Any

import aiomqtt
import pytest
from pydantic import BaseModel, ValidationError

from protocol import token_stream
from protocol.messages import (
    MAX_MESSAGE_BYTES,
    QOS,
    CancelCmd,
    DecodeCmd,
    Done,
    ExtendCmd,
    Extended,
    Failed,
    HandoffAck,
    HandoffCmd,
    HandoffSent,
    KvReceived,
    KvSent,
    KVTarget,
    MainPart,
    PrefillCmd,
    PrefillDone,
    RelayPart,
    Request,
    RequestHints,
    RouterStatus,
    Status,
    Tokens,
    WarmCmd,
    parse_command,
    parse_event,
    rid_of,
)
from protocol.messages import (
    Tokens as TokensMsg,
)
from protocol.mqtt_session import Session
from protocol.router_config import PlanInfo, PolicyContext, PolicyReport, RequestRecord, RouterConfig, WorkerEndpoint
from protocol.token_stream import TokenChunk
from protocol.topics import Topics
from protocol.worker_config import (
    BrokerInfo,
    CacheReport,
    DecodeCounters,
    DeviceReport,
    DeviceSpec,
    PrefillCounters,
    WorkerConfig,
    WorkerFaults,
    WorkerStats,
)
from testbed.deploy.cluster import Cluster
from testbed.deploy.deployment import Deployment
from testbed.load.trace_replay import TraceReplay
from testbed.net import netns
from testbed.net.delayline_contract import DelayLineConfig, DelayLineReport, DirectionConfig, DirectionReport
from testbed.policies import PolicySpec, describe, make_policy, parse_policy, parse_policy_list
from testbed.policies.pdd import Pdd
from testbed.scenario import Role
from testbed.traces.workload import RequestSpec, synth_tokens

from .conftest import needs_root, scenario_with

BROKER = BrokerInfo(host="10.213.1.11", port=1883, username="pddabc", password="s3cret")
STAMP: dict[str, Any] = {"rid": "r1", "worker": "decode-b", "t": 1700000000.25}

COMMANDS = [
    PrefillCmd(rid="r1", prompt=[5, 6, 7], kv_to=[KVTarget(worker="relay", host="10.213.1.13", port=7070)]),
    DecodeCmd(rid="r1", prompt=[5, 6], max_new=8),
    DecodeCmd(rid="r1", prompt=[5, 6], max_new=8, relay=RelayPart(main="decode-b", eager_budget=3)),
    DecodeCmd(rid="r1", prompt=[5, 6], max_new=8, drc=False, main=MainPart(relay="relay")),
    CancelCmd(rid="r1", target="decode-b"), CancelCmd(rid="r1", keep_kv=True),
    HandoffCmd(rid="r1", mode="catch-up", batch=16), HandoffCmd(rid="r1", mode="local"),
    HandoffAck(rid="r1", extended=16), ExtendCmd(rid="r1", start=4, tokens=[9, 10], final=True),
    WarmCmd(rid="r1", tokens=[5, 6, 7, 8], start=2),
]  # fmt: skip

EVENTS = [
    PrefillDone(**STAMP, hit_tokens=64, computed=36, first_token=7, start=1.0, end=1.5, real_s=0.4, modeled_s=0.5),
    KvSent(**STAMP, to="decode-b", bytes=4096, written=4200, payload=4000, planned_payload=8000, tokens=1, had=15,
           start=1.0, end=1.2, cancelled=True),
    KvReceived(**STAMP, bytes=4096, had=15, start=1.0, end=1.2, cache_only=True),
    HandoffSent(**STAMP, tokens=8, start=0, final=False, to="decode-b"),
    Extended(**STAMP, tokens=8, start=0, final=True, mismatches=0, compute_s=0.01, t_start=2.0, since_kv_s=0.1),
    Done(**STAMP, output_tokens=12, kv_bytes=4096, handed_off=False, eager=12, batches=[4, 8]),
    Failed(**STAMP, reason="KV transfer to decode-b: broke", target="decode-b", before_handoff=True),
]  # fmt: skip


def _round_trip(m: BaseModel) -> None:
    assert type(m).model_validate_json(m.model_dump_json()) == m


def test_every_command_and_event_round_trips_through_its_union() -> None:
    for cmd in COMMANDS:
        assert parse_command(cmd.dump()) == cmd
    assert {type(c).__name__ for c in COMMANDS} >= {"PrefillCmd", "DecodeCmd", "CancelCmd", "HandoffCmd",
                                                    "HandoffAck", "ExtendCmd", "WarmCmd"}
    for ev in EVENTS:
        assert parse_event(ev.dump()) == ev
    assert len({type(e) for e in EVENTS}) == 7


def test_configs_records_and_reports_round_trip() -> None:
    wc = WorkerConfig(name="decode-b", role="decode", run_id="abc123", host_ip="10.213.2.10", broker=BROKER,
                      model_path="/m", device=DeviceSpec(name="gpu-b", peak_tflops=400, mem_gbps=4800),
                      faults=WorkerFaults(die_after_tokens=20))
    for spec in (parse_policy("same-dc"), parse_policy("cross-dc"), parse_policy("pdd:handoff=one-shot,drc=off")):
        rc = RouterConfig(run_id="abc123", broker=BROKER, policy=spec, request_timeout_s=30,
                          workers={"decode-b": WorkerEndpoint(role="decode", dc="b", host="10.213.2.10", kv_port=7070)},
                          records_path="/tmp/r.jsonl", context=PolicyContext(wan_rate_bps=1e9, kv_bytes_per_token=4096))
        back = RouterConfig.model_validate_json(rc.model_dump_json())
        assert back == rc and type(back.policy) is type(spec)
    stats = WorkerStats(worker="decode-b", role="decode", device=DeviceReport(device="native", steps=3),
                        cache=CacheReport(hit_rate=0.5, blocks=2, hit_tokens=16, lookup_tokens=32,
                                          series=[(1.0, 0, 16), (2.0, 16, 32)]),
                        decode=DecodeCounters(step_ms_by_batch={1: 9.5, 4: 20.0}, tokens_out=40))
    record = RequestRecord(rid="r1", pipeline="P-RLD-MD", prefill="prefill", decode="decode-b", relay="relay",
                           prefill_dc="a", decode_dc="b", plan_info=PlanInfo(delta_tokens=48, est_wan_wait_s=0.3),
                           events=list(EVENTS))
    dl = DelayLineConfig(ports={"a": "wa", "b": "wb"}, stats_path="/tmp/s.json",
                         directions=[DirectionConfig(src="a", dst="b", delay_ms=15, max_backlog_bytes=10_000)])
    rep = DelayLineReport(pid=1, uptime_s=2.0, final=True, directions={"a->b": DirectionReport(
        frames_in=1, bytes_in=2, frames_out=1, bytes_out=2, drop_loss=0, drop_queue_full=0, drop_overflow=0,
        drop_error=0, backlog_max_bytes=2, late_max_us=5.0, late_over_1ms=0, delay_sum_ms=15.0, backlog_bytes=0)})
    for m in (wc, stats, record, dl, rep, PolicyReport(counts={"P-MD": 3}, options="pdd:handoff=adaptive"),
              Request(rid="r1", prompt=[1, 2], max_new=3, hints=RequestHints(session="s", turn=2, eager=0)),
              TokensMsg(rid="r1", start=0, tokens=[4], worker="decode-b", t=1.0, done=True),
              Status(worker="relay", role="relay-decode", state="up", cache_hit_rate=0.9),
              RouterStatus(state="ready", workers={"relay": "relay-decode"}, policy="pdd"),
              WorkerStats(worker="prefill", role="prefill", device=DeviceReport(device="native"),
                          prefill=PrefillCounters(computed_tokens=5))):
        _round_trip(m)
    assert RequestRecord.model_validate_json(record.model_dump_json()).events == EVENTS  # each kind restored


@pytest.mark.parametrize("payload, complaint", [
    (b'{"op": "decode", "rid": "r1", "prompt": [1], "max_new": 0}', "max_new"),  # out of range
    (b'{"op": "decode", "rid": "r1", "prompt": [1]}', "max_new"),  # missing field
    (b'{"op": "extend", "rid": "r1", "start": "two"}', "start"),  # wrong type
    (b'{"op": "handoff", "rid": "r1", "mode": "sideways"}', "mode"),  # not one of the modes
    (b'{"op": "cancel", "rid": "r1", "options": {"target": "x"}}', "options"),  # unknown field
    (b'{"op": "decode", "rid": "r1", "prompt": [1], "max_new": 2, "relay": {"main": "b"}, "main": {"relay": "a"}}',
     "not both"),
    (b'{"op": "launch", "rid": "r1"}', "op"),  # unknown command
])  # fmt: skip
def test_malformed_commands_are_rejected_naming_the_field(payload: bytes, complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        parse_command(payload)
    assert rid_of(payload) == "r1"


def test_malformed_events_and_requests_are_rejected() -> None:
    with pytest.raises(ValidationError, match="reason"):
        parse_event(b'{"kind": "failed", "rid": "r1", "worker": "w", "t": 1}')
    with pytest.raises(ValidationError, match="bytes"):
        parse_event(b'{"kind": "kv_sent", "rid": "r1", "worker": "w", "t": 1, "to": "b", "bytes": -1}')
    with pytest.raises(ValidationError, match="prompt"):
        Request.model_validate_json(b'{"rid": "r1", "prompt": [], "max_new": 1}')
    with pytest.raises(ValidationError, match="meta"):
        Request.model_validate_json(b'{"rid": "r1", "prompt": [1], "max_new": 1, "meta": {}}')
    for bad in (b"-1", b"2147483648", b"99999999999999999999999"):  # the router holds ids as 4-byte ints
        with pytest.raises(ValidationError, match="prompt.1"):
            Request.model_validate_json(b'{"rid": "r1", "prompt": [1, ' + bad + b'], "max_new": 1}')
        with pytest.raises(ValidationError, match="answer.0"):
            Request.model_validate_json(b'{"rid": "r1", "prompt": [1], "max_new": 1, '
                                        b'"hints": {"answer": [' + bad + b"]}}")
    assert rid_of(b"\xff not json") is None and rid_of(b"[1, 2]") is None and rid_of(b'{"rid": 3}') is None


@pytest.mark.hostile
@pytest.mark.parametrize("rid", ["a#b", "a+b", "a/b", "a b", "", "x" * 129, "\u00e9t\u00e9"])
def test_an_id_that_cannot_be_a_topic_or_a_file_name_is_refused_everywhere(rid: str) -> None:
    """A request id becomes a topic (tokens/<rid>), a file name and a CSV cell: every
    message that carries one refuses a malformed one, and a rejected message's id is not
    reused to answer it."""
    for payload in ({"op": "prefill", "rid": rid, "prompt": [1]}, {"op": "cancel", "rid": rid},
                    {"op": "warm", "rid": rid, "tokens": [1, 2], "start": 1}):
        with pytest.raises(ValidationError, match="rid"):
            parse_command(json.dumps(payload))
    with pytest.raises(ValidationError, match="rid"):
        parse_event(json.dumps({"kind": "failed", "rid": rid, "worker": "w", "t": 1, "reason": "x"}))
    with pytest.raises(ValidationError, match="rid"):
        Tokens.model_validate_json(json.dumps({"rid": rid, "start": 0, "tokens": [], "worker": "w", "t": 1}))
    assert rid_of(json.dumps({"rid": rid, "op": "cancel"})) is None


def test_policy_spec_is_parsed_once_and_crosses_as_a_typed_spec() -> None:
    specs = parse_policy_list("same-dc,pdd:handoff=catch-up,threshold=32,cross-dc")
    assert [s.label for s in specs] == ["same-dc", "pdd:handoff=catch-up,threshold=32", "cross-dc"]
    pdd = specs[1]
    assert pdd.name == "pdd" and pdd.source is None and pdd.options == {"handoff": "catch-up", "threshold": 32}
    back = PolicySpec.model_validate_json(pdd.model_dump_json())
    assert back == pdd
    assert describe(pdd).startswith("pdd:handoff=catch-up,threshold=32,load=4,relay_s=0.5,drc=on")
    policy = make_policy(back)
    assert isinstance(policy, Pdd) and policy.opts.handoff == "catch-up" and policy.describe() == describe(pdd)
    assert parse_policy("same-dc") == PolicySpec(name="same-dc")


# ------------------------------------------------------------------------- live cluster (root)
def _inject_when_streaming(cl: Cluster, victim: str, worker: str, seen: dict[str, Any]) -> threading.Thread:
    """A second client in the client's namespace: once ``victim`` streams, send a malformed
    command about it to ``worker``, a malformed request and a non-JSON command; record what
    comes back."""
    ns = cl.net.ns_of(cl.net.scenario.hosts_with_role(Role.CLIENT)[0])
    topics: Topics = cl.topics

    async def body() -> None:
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(2, initializer=netns.join, initargs=(ns,)))
        b = cl.access.admin  # the orchestrator may use every topic of the run
        async with aiomqtt.Client(b.host, b.port, username=b.username, password=b.password,
                                  identifier=f"{topics.root}-injector") as c:
            for t in (topics.stream(worker), topics.tokens("bad-req"), topics.all_events):
                await c.subscribe(t, qos=QOS)
            async with asyncio.timeout(90):
                async for msg in c.messages:
                    payload = msg.payload
                    assert isinstance(payload, (bytes, bytearray))
                    if "injected" not in seen and str(msg.topic) == topics.stream(worker) \
                            and any(ch.rid == victim for ch in token_stream.decode(payload)[2]):
                        seen["injected"] = time.time()
                        await c.publish(topics.cmd(worker), b'{"op": "extend", "rid": "%s", "start": -1}'
                                        % victim.encode(), qos=QOS)
                        await c.publish(topics.requests, b'{"rid": "bad-req", "prompt": "text", "max_new": 3}',
                                        qos=QOS)
                        await c.publish(topics.cmd("prefill"), b"\xff not json", qos=QOS)
                        # Ids that cannot be topics, and a repeat of a request in flight.
                        await c.publish(topics.requests, b'{"rid": "a#b", "prompt": [5], "max_new": 3}', qos=QOS)
                        await c.publish(topics.cmd(worker), b'{"op": "cancel", "rid": "x#y"}', qos=QOS)
                        await c.publish(topics.requests, Request(rid=victim, prompt=[5, 6], max_new=2).dump(), qos=QOS)
                        # Malformed token messages: one naming a request of the client, one not.
                        await c.publish(topics.tokens("victim2"), b'{"rid": "victim2", "start": "x"}', qos=QOS)
                        await c.publish(topics.tokens("ghost"), b"[1, 2", qos=QOS)
                        # A binary batch cut short after naming victim3, and one naming nothing.
                        whole = token_stream.encode(worker, time.time(), [TokenChunk("victim3", 0, [5, 6], worker)])
                        await c.publish(topics.stream(worker), whole[:-3], qos=QOS)
                        await c.publish(topics.stream(worker), b"PTS1 garbage", qos=QOS)
                        # What a parser may choke on, to every reader: nesting past any
                        # recursion limit, numbers out of range, invalid UTF-8, a payload
                        # over the size a message may have.
                        for payload in HOSTILE_PAYLOADS:
                            for topic in (topics.requests, topics.events(worker), topics.cancels, topics.cmd(worker),
                                          topics.cmd("prefill"), topics.tokens("ghost"), topics.stream(worker)):
                                await c.publish(topic, payload, qos=QOS)
                    elif str(msg.topic) == topics.tokens("bad-req"):
                        seen["bad-req"] = Tokens.model_validate_json(payload)
                    elif str(msg.topic).endswith("/events"):
                        ev = parse_event(payload)
                        if isinstance(ev, Failed) and ev.rid == victim:
                            seen["failed"] = ev
                    if "bad-req" in seen and "failed" in seen:
                        return

    def run() -> None:
        with netns.entered(ns):
            try:
                asyncio.run(body())
            except BaseException as e:  # noqa: BLE001 - reported through ``seen``
                seen["error"] = repr(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


_DEEP = b"[" * 5000 + b"]" * 5000
HOSTILE_PAYLOADS = [
    b'{"rid": ' + _DEEP + b"}",
    b'{"op": "cancel", "rid": "victim", "x": ' + _DEEP + b"}",
    b'{"kind": "failed", "rid": "victim", "worker": "w", "t": 1e999999, "reason": "x"}',
    b'{"op": "extend", "rid": "victim", "start": 1' + b"0" * 5000 + b"}",
    b'{"op": "cancel", "rid": "\xff\xfe"}',
    b'{"rid": "victim", "prompt": [1], "max_new": 1, "hints": {"tag": "\xc3\x28"}}',
    b"x" * (MAX_MESSAGE_BYTES + 1),
]


@pytest.mark.hostile
@pytest.mark.parametrize("payload", HOSTILE_PAYLOADS, ids=["deep", "deep-field", "inf", "huge-int", "bad-utf8",
                                                            "bad-utf8-field", "oversize"])
def test_the_request_id_of_a_hostile_payload_is_read_without_raising(payload: bytes) -> None:
    """``rid_of`` reads any payload (``json.loads`` raised RecursionError on the first)."""
    assert rid_of(payload) in (None, "victim")
    for parse in (parse_command, parse_event, Request.model_validate_json, Tokens.model_validate_json):
        with pytest.raises(ValidationError):
            parse(payload)


@pytest.mark.hostile
def test_a_handler_that_raises_fails_its_message_and_the_session_reads_on() -> None:
    """``Session`` guards every reader: a handler's exception and an oversized message are
    handed to ``on_error`` with the topic, and the next message is read."""

    class Msg:
        def __init__(self, topic: str, payload: bytes) -> None:
            self.topic, self.payload = topic, payload

    class Client:
        async def _gen(self) -> Any:
            for m in (Msg("a", b'{"rid": "r1"}'), Msg("b", b"x" * (MAX_MESSAGE_BYTES + 1)), Msg("c", b"ok")):
                yield m

        @property
        def messages(self) -> Any:
            return self._gen()

    handled: list[str] = []
    refused: list[tuple[str, str]] = []

    async def on_message(m: Any) -> None:
        if m.topic == "a":
            raise KeyError("boom")
        handled.append(m.topic)

    async def on_error(topic: str, payload: bytes, why: str) -> None:
        refused.append((topic, why))

    session = Session(Client(), [], "test")  # type: ignore[arg-type]
    session.on_error = on_error
    asyncio.run(session._read(on_message))
    assert handled == ["c"]
    assert [t for t, _ in refused] == ["a", "b"] and "KeyError" in refused[0][1] and "bytes" in refused[1][1]
    assert session.refused == 2


@pytest.mark.hostile
@needs_root
def test_a_malformed_message_fails_only_the_request_it_names() -> None:
    victim = "victim"
    specs = [RequestSpec(victim, synth_tokens("victim", 200), 400, at=0.0),
             RequestSpec("victim2", synth_tokens("victim2", 200), 400, at=0.0),
             RequestSpec("victim3", synth_tokens("victim3", 200), 400, at=0.0)] + [
        RequestSpec(f"ok{i}", synth_tokens(f"ok-{i}", 80), 20, at=0.3 * (i + 1)) for i in range(6)]
    seen: dict[str, Any] = {}
    with Deployment(scenario_with(), parse_policy("same-dc")) as dep:
        injector = _inject_when_streaming(dep.cluster, victim, "decode-a", seen)
        _, recs = TraceReplay(specs, timeout_s=120).drive(dep, lambda t0: None)
        injector.join(timeout=30)
        later = TraceReplay([RequestSpec("later", synth_tokens("later", 50), 10)], timeout_s=60)
        _, after = later.drive(dep, lambda t0: None)  # still serving
        logs = {name: dep.cluster.log_tail(name, 20000) for name in ("worker-decode-a", "worker-prefill", "router")}
    assert "error" not in seen, seen
    v = recs[victim]
    assert not v.ok and v.error is not None and "decode-a rejected a command: extend.start:" in v.error, v.error
    assert 0 < len(v.tokens) < 400
    assert seen["failed"].worker == "decode-a"
    v2 = recs["victim2"]  # the client's reader survived both and failed only the request named
    assert not v2.ok and v2.error is not None and v2.error.startswith("client rejected a token message: start:"), v2
    v3 = recs["victim3"]
    assert not v3.ok and v3.error is not None and "token batch: chunk 0 (victim3) tokens: truncated" in v3.error, v3
    assert all(r.ok and len(r.tokens) == 20 for rid, r in recs.items() if not rid.startswith(victim)), \
        {rid: r.error for rid, r in recs.items()}
    assert after["later"].ok and len(after["later"].tokens) == 10
    bad = seen["bad-req"]
    assert bad.done and bad.error and "router rejected a request: prompt:" in bad.error
    assert "rejected a command for victim" in logs["worker-decode-a"]
    assert "rejected a command for no request" in logs["worker-prefill"]
    assert "rejected a message on" in logs["router"] and "bad-req" in logs["router"]
    assert "rejected a message on" in logs["router"] and "for no request: rid:" in logs["router"]  # a#b
    assert "rejected a command for no request: cancel.rid:" in logs["worker-decode-a"]  # x#y
    assert "dropped a repeated request victim" in logs["router"]  # the victim kept its own state
    for name in ("router", "worker-decode-a", "worker-prefill"):  # the hostile payloads: refused, logged
        assert "recursion limit exceeded" in logs[name] and "Traceback" not in logs[name], (name, logs[name][-3000:])


@needs_root
def test_a_router_that_dies_is_announced_by_its_will_and_its_requests_fail_at_once() -> None:
    specs = [RequestSpec(f"r{i}", synth_tokens(f"r-{i}", 100), 3000, at=0.1 * i) for i in range(3)]
    with Deployment(scenario_with(), parse_policy("same-dc")) as dep:
        router = dep.cluster.router
        assert router is not None

        def kill_when_started(t0: float) -> None:
            threading.Timer(2.0, os.kill, (router.pid, signal.SIGKILL)).start()

        t0 = time.monotonic()
        _, recs = TraceReplay(specs, timeout_s=300, router_grace_s=2.0).drive(dep, kill_when_started)
        took = time.monotonic() - t0
    # The broker publishes the will ~1.5 keepalives (5 s) after the router went silent; the
    # client waits its grace (10 s by default, 2 here) for a "ready" (a broker restart).
    assert took < 40, took
    assert all(not r.ok and r.error == "router down: not answered" for r in recs.values()), \
        {rid: r.error for rid, r in recs.items()}
