"""Hostile input at the edges (no network): the KV receiver and the control-message decoders
take anything a peer can send and answer with a reason, never a crash, a hang or an
allocation the peer chose.

The fuzzing is seeded (``random.Random``), so every run tries the same inputs: a failure
reproduces, and the suite cannot flake on an unlucky draw."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import struct

import pytest
import torch
from pydantic import ValidationError

from protocol import kv_format, token_stream
from protocol.messages import SAFE_NAME, Request, RouterStatus, Status, Tokens, parse_command, parse_event
from protocol.stream_gate import StreamGate
from protocol.token_stream import TokenChunk
from protocol.topics import Topics
from testbed.policies import RequestState
from workers import kv_wire
from workers.kv_wire import BLOCK, END, HDR, HELLO, MAGIC, VERSION, ModelShape

pytestmark = pytest.mark.hostile

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
FUZZ_INPUTS = 10_000


def _frame(ftype: int, payload: bytes) -> bytes:
    return HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)) + payload


def _hello(**over: object) -> dict[str, object]:
    h: dict[str, object] = {"rid": "r1", "tokens": list(range(3, 35)), "dtype": "torch.float32", "layers": 2,
                            "kv_heads": 2, "head_dim": 4, "block_size": 16}
    return {**h, **over}


def _valid_stream(kv: torch.Tensor, hello: dict[str, object] | None = None) -> bytes:
    n = kv.shape[3]
    out = _frame(HELLO, json.dumps(hello or _hello(tokens=list(range(3, 3 + n)))).encode())
    for idx, start in enumerate(range(0, n, 16)):
        out += _frame(BLOCK, kv_wire.encode_block(idx, start, kv[:, :, :, start : start + 16])[0])
    return out + _frame(END, json.dumps({"first_token": 7, "n": n}).encode())


class _Writer:
    """What the receiver writes back, in memory."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


async def _receive(stream: bytes, have: int = 0, token: str = "") -> dict[str, object]:
    """Feed ``stream`` to the receiver, then end of file; what it concluded."""
    got: dict[str, object] = {}

    async def offer(rid: str, tokens: list[int], ticket: str) -> int:
        return have

    async def done(inc: kv_wire.Incoming) -> None:
        got["done"] = inc

    async def fail(rid: str, msg: str) -> None:
        got["fail"] = msg

    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    writer = _Writer()
    await asyncio.wait_for(kv_wire.receive_kv(reader, writer, offer, done, fail, SHAPE, token),  # type: ignore[arg-type]
                           timeout=2.0)
    got["closed"] = writer.closed
    got["reply"] = bytes(writer.data)
    return got


def receive(stream: bytes, have: int = 0, token: str = "") -> dict[str, object]:
    return asyncio.run(_receive(stream, have, token))


def test_a_valid_stream_is_received_exactly() -> None:
    kv = torch.randn(2, 2, 2, 40, 4)
    got = receive(_valid_stream(kv))
    inc = got["done"]
    assert isinstance(inc, kv_wire.Incoming) and torch.equal(inc.kv, kv) and inc.first_token == 7
    assert "fail" not in got and got["closed"]


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (_frame(HELLO, b"[1, 2, 3]"), None),  # list-shaped HELLO: no request id to fail
        (_frame(HELLO, json.dumps(_hello(dtype="torch.int8")).encode()), None),
        (_frame(HELLO, json.dumps(_hello(rid="a/b")).encode()), None),
        (_frame(HELLO, json.dumps(_hello(tokens=[-1, 5])).encode()), None),
        (_frame(HELLO, json.dumps(_hello(layers=3)).encode()), "is not this worker's"),
        (_frame(HELLO, json.dumps(_hello(head_dim=1 << 20, layers=1 << 12)).encode()), None),
        (HDR.pack(MAGIC, VERSION, HELLO, 0, 0xFFFFFFFF), None),  # announces 4 GB, sends nothing
        (_frame(HELLO, json.dumps(_hello()).encode()) + HDR.pack(MAGIC, VERSION, BLOCK, 0, 0xFFFFFFF0),
         "at most"),
        (_frame(HELLO, json.dumps(_hello()).encode()) + _frame(BLOCK, b"\x00" * 10), "shorter than its header"),
        (_frame(HELLO, json.dumps(_hello()).encode()) + _frame(END, b'{"first_token": 1, "n": 32}'),
         "ended at token 0 of 32"),
        (_frame(HELLO, json.dumps(_hello()).encode()) + b"PDKV", "failed"),  # cut mid-header
    ],
)
def test_hostile_streams_fail_the_transfer_with_a_reason(stream: bytes, reason: str | None) -> None:
    got = receive(stream)
    assert "done" not in got and got["closed"]
    if reason is None:  # the request id was not (validly) given: nothing to fail, the peer is told
        assert "fail" not in got
    else:
        assert reason in str(got["fail"]), got["fail"]
    assert b'"error"' in got["reply"]  # the sender learns why


def test_only_a_sender_with_the_runs_token_is_served() -> None:
    kv = torch.randn(2, 2, 2, 32, 4)
    good = receive(_valid_stream(kv, _hello(token="s3cret")), token="s3cret")
    assert "done" in good
    for hello in (_hello(), _hello(token="guess")):
        got = receive(_valid_stream(kv, hello), token="s3cret")
        # Refused before the request id is trusted: a stranger cannot fail the run's requests.
        assert "done" not in got and "fail" not in got and b"KV token" in got["reply"]


def test_a_block_lying_about_its_token_count_is_refused() -> None:
    kv = torch.randn(2, 2, 2, 32, 4)
    payload, _ = kv_wire.encode_block(0, 0, kv[:, :, :, :16])
    lying = payload[:8] + struct.pack("!I", 17) + payload[12:]  # says 17 tokens, carries 16
    got = receive(_frame(HELLO, json.dumps(_hello()).encode()) + _frame(BLOCK, lying))
    assert "checksum" not in str(got["fail"]) and "bytes for 17 tokens" in str(got["fail"])


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_modeled_workers_cached_zero_frames_are_the_frames_of_its_kv(corrupt: bool) -> None:
    kv = torch.zeros(2, 2, 2, 32, 4, dtype=torch.float64)
    for start in (0, 16):
        part = kv[:, :, :, start : start + 16]
        assert kv_wire.encode_zero_block(1, start, part, corrupt) == kv_wire.encode_block(1, start, part, corrupt)


def test_a_modeled_receiver_checks_a_block_as_decoding_it_would() -> None:
    shape = (2, 2, 4, torch.float64)  # layers, KV heads, head dim, dtype
    zeros = torch.zeros(2, 2, 2, 16, 4, dtype=torch.float64)
    data = torch.randn(2, 2, 2, 16, 4, dtype=torch.float64)
    for part in (zeros, data):  # a modeled sender's zeros (compared) and a real sender's KV (checksummed)
        good, _ = kv_wire.encode_block(3, 32, part)
        assert kv_format.check_block(good, *shape) == (32, 16) and kv_format.decode_block(good, *shape).first == 32
        for bad in (kv_wire.encode_block(3, 32, part, corrupt=True)[0], good[:-1] + b"\x01"):
            for check in (kv_format.check_block, kv_format.decode_block):
                with pytest.raises(kv_wire.KVTransferError, match="checksum mismatch"):
                    check(bad, *shape)
    with pytest.raises(kv_wire.KVTransferError, match="unexpected shape"):
        kv_format.check_block(kv_wire.encode_block(3, 32, zeros)[0], 2, 2, 8, torch.float64)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:  # cut
            del b[rng.randrange(len(b)) :]
        elif op == 2:  # insert random bytes
            at = rng.randrange(len(b) + 1)
            b[at:at] = rng.randbytes(rng.randint(1, 64))
        elif op == 3 and len(b) > 12:  # a length field anywhere
            at = rng.randrange(len(b) - 4)
            b[at : at + 4] = struct.pack("!I", rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]))
        else:  # duplicate a slice
            i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
            b[j:j] = b[i:j]
    return bytes(b)


def test_fuzzed_streams_never_crash_hang_or_succeed_wrongly() -> None:
    rng = random.Random(20261130)
    kv = torch.randn(2, 2, 2, 48, 4)
    good = _valid_stream(kv)
    hello_end = HDR.size + HDR.unpack_from(good)[4]

    async def main() -> tuple[int, int]:
        done = failed = 0
        for _ in range(FUZZ_INPUTS):
            # A third of the inputs mutate only HELLO (JSON, the richest parser), the rest anywhere.
            only_hello = rng.random() < 1 / 3
            stream = _mutate(rng, good[:hello_end]) + good[hello_end:] if only_hello else _mutate(rng, good)
            got = await _receive(stream)  # raises on a crash, times out on a hang
            assert got["closed"]
            if "done" in got:
                inc = got["done"]
                assert isinstance(inc, kv_wire.Incoming)
                # Success only with every checksum intact: the KV is what the sender sent.
                assert inc.kv.shape == (2, 2, 2, len(inc.tokens), 4)
                done += 1
            failed += "fail" in got
        return done, failed

    done, failed = asyncio.run(main())
    assert failed > FUZZ_INPUTS // 4  # most mutations reach a request id and are refused with a reason
    assert done < FUZZ_INPUTS // 10


def test_fuzzed_control_messages_are_models_or_validation_errors() -> None:
    rng = random.Random(7)
    seeds = [
        b'{"op": "prefill", "rid": "r1", "prompt": [5, 6, 7], "targets": []}',
        b'{"op": "extend", "rid": "r1", "start": 3, "tokens": [1, 2], "final": true}',
        b'{"kind": "failed", "rid": "r1", "worker": "w", "t": 1.0, "reason": "x"}',
        b'{"rid": "r1", "start": 0, "tokens": [1], "worker": "w", "t": 0.5, "done": false}',
        b'{"rid": "r1", "prompt": [1, 2, 3], "max_new": 4}',
        b'{"state": "ready", "workers": {}, "policy": "same-dc"}',
    ]
    decoders = [parse_command, parse_event, Tokens.model_validate_json, Request.model_validate_json,
                RouterStatus.model_validate_json, Status.model_validate_json]
    for _ in range(FUZZ_INPUTS):
        data = _mutate(rng, rng.choice(seeds)) if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 200))
        for decode in decoders:
            with contextlib.suppress(ValidationError):
                msg = decode(data)
                if isinstance(msg, Request):  # what the router holds of an admitted request
                    RequestState(msg.rid, msg.prompt, msg.max_new, 0.0, msg.hints)


# ------------------------------------------------------------------------- token batches
BATCH = [TokenChunk("r1", 0, [5, 6], "decode-a"), TokenChunk("r2", 7, [], "decode-a", done=True),
         TokenChunk("r3", 2, [2**32 - 1], "decode-a", done=True, error="KV lost: ü")]


def test_a_token_batch_round_trips_every_field() -> None:
    worker, t, chunks = token_stream.decode(token_stream.encode("decode-a", 12.5, BATCH))
    assert (worker, t, chunks) == ("decode-a", 12.5, BATCH)
    with pytest.raises(ValueError, match="1 to 65535 chunks"):
        token_stream.encode("decode-a", 0.0, [])


def _batch_with(chunk: bytes, worker: bytes = b"w", n: int = 1, magic: bytes = token_stream.MAGIC) -> bytes:
    return struct.pack("<4sdBH", magic, 1.0, len(worker), n) + worker + chunk


def _chunk(rid: bytes, start: int, flags: int, tokens: list[int], tail: bytes = b"") -> bytes:
    return bytes((len(rid),)) + rid + struct.pack(f"<IBI{len(tokens)}I", start, flags, len(tokens), *tokens) + tail


@pytest.mark.parametrize(("payload", "why", "rids"), [
    (_batch_with(_chunk(b"r1", 0, 0, [1]), magic=b"XXXX"), "header: magic", []),
    (_batch_with(b"", n=0), "header: no chunks", []),
    (_batch_with(_chunk(b"r1", 0, 0, [1]), worker=b"a/b"), "worker: 'a/b' is not a valid name", []),
    (_batch_with(_chunk(b"r#1", 0, 0, [1])), "chunk 0 rid: 'r#1' is not a valid name", []),
    (_batch_with(_chunk(b"r1", 0, 8, [1])), "chunk 0 (r1): unknown flags 0x8", ["r1"]),
    (_batch_with(_chunk(b"r1", 0, 2, [1])), "chunk 0 (r1): an error that does not end the stream", ["r1"]),
    (_batch_with(_chunk(b"r1", 0, 0, [1])[:-1]), "chunk 0 (r1) tokens: truncated", ["r1"]),
    (_batch_with(_chunk(b"r1", 0, 0, [1]), n=2), "chunk 1 rid length: truncated", ["r1"]),
    (_batch_with(_chunk(b"r1", 0, 0, [1]) + b"x"), "1 bytes after the last chunk", ["r1"]),
    (_batch_with(_chunk(b"r1", 0, 0, [1]) + _chunk(b"r2", 0, 3, [], b"\x02\x00\xff\xfe"), n=2),
     "chunk 1 (r2) error: not UTF-8", ["r1", "r2"]),
    (_batch_with(_chunk(b"r1", 0, 0, [2**20])[:-4]), "chunk 0 (r1) tokens: truncated", ["r1"]),  # n says 1
    (struct.pack("<4sdBH", token_stream.MAGIC, float("nan"), 1, 1) + b"w", "header: send time nan", []),
])
def test_a_hostile_token_batch_is_refused_naming_the_requests_it_named(payload: bytes, why: str,
                                                                      rids: list[str]) -> None:
    with pytest.raises(token_stream.TokenStreamError, match=re.escape(why)) as e:
        token_stream.decode(payload)
    assert e.value.rids == rids


def test_names_a_reader_has_checked_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request ids recur in every step's batch, so a checked name is looked up, not matched
    again; the memory of them is bounded, and a name that failed is never remembered."""
    monkeypatch.setattr(token_stream, "_NAMES", {})
    monkeypatch.setattr(token_stream, "NAMES_KEPT", 4)
    for i in range(10):
        batch = token_stream.encode("decode-a", 1.0, [TokenChunk(f"r{i}", 0, [1], "decode-a")])
        assert token_stream.decode(batch)[2] == [TokenChunk(f"r{i}", 0, [1], "decode-a")]
        assert 0 < len(token_stream._NAMES) <= 4
    for _ in range(2):
        with pytest.raises(token_stream.TokenStreamError, match=re.escape("chunk 0 rid: 'r#1' is not a valid name")):
            token_stream.decode(_batch_with(_chunk(b"r#1", 0, 0, [1])))
    assert b"r#1" not in token_stream._NAMES


def _gate(*rids: str, max_new: int = 8) -> tuple[Topics, StreamGate]:
    topics = Topics("t")
    gate = StreamGate(topics, "client")
    for rid in rids:
        gate.expect(rid, max_new)
    return topics, gate


def _named(topics: Topics, rid: str, *workers: str) -> bytes:
    return Tokens(rid=rid, start=0, tokens=[], worker="router", t=1.0, streamers=list(workers)).dump()


def test_a_reader_takes_a_requests_tokens_only_from_the_workers_the_router_named(capsys) -> None:  # noqa: ANN001
    """decode-b streaming into r1 (named: decode-a) is refused and logged once; decode-a's
    chunks pass; a request the reader does not wait for passes nothing."""
    topics, gate = _gate("r1")
    assert gate.read(topics.tokens("r1"), _named(topics, "r1", "decode-a")) == []
    rogue = token_stream.encode("decode-b", 1.0, [TokenChunk("r1", 0, [9, 9], "decode-b")])
    assert gate.read(topics.stream("decode-b"), rogue) == []
    assert gate.read(topics.stream("decode-b"), rogue) == []
    assert gate.read(topics.stream("decode-a"), token_stream.encode("decode-a", 1.0, BATCH[:1])) == BATCH[:1]
    other = token_stream.encode("decode-a", 1.0, [TokenChunk("r7", 0, [1], "decode-a")])
    assert gate.read(topics.stream("decode-a"), other) == []
    assert gate.refused == 2
    assert capsys.readouterr().err.count("client: refused tokens for r1 from decode-b: not a worker the router "
                                         "named for it (decode-a)") == 1


def test_chunks_before_their_announcement_wait_bounded_then_pass_or_are_refused() -> None:
    topics, gate = _gate("r1", max_new=3)
    a = [TokenChunk("r1", 0, [1], "decode-a"), TokenChunk("r1", 1, [2], "decode-a")]
    assert gate.read(topics.stream("decode-a"), token_stream.encode("decode-a", 1.0, a)) == []
    b = token_stream.encode("decode-b", 1.0, [TokenChunk("r1", 2, [3], "decode-b")])
    assert gate.read(topics.stream("decode-b"), b) == []
    flood = token_stream.encode("decode-b", 1.0, [TokenChunk("r1", 3, [4, 5], "decode-b")])
    assert gate.read(topics.stream("decode-b"), flood) == []  # past max_new while waiting: refused
    assert gate.refused == 1
    assert gate.read(topics.tokens("r1"), _named(topics, "r1", "decode-a")) == a  # b's chunk refused now
    assert gate.refused == 2


def test_a_malformed_batch_fails_only_the_requests_its_sender_was_named_for() -> None:
    """A batch on another worker's topic, or a broken one, names the requests its sender
    (the topic's worker) may speak for: decode-b cannot fail decode-a's request."""
    topics, gate = _gate("r1", "r2")
    gate.read(topics.tokens("r1"), _named(topics, "r1", "decode-a"))
    gate.read(topics.tokens("r2"), _named(topics, "r2", "decode-b"))
    forged = token_stream.encode("decode-a", 1.0, [TokenChunk("r1", 0, [1], "decode-a"),
                                                   TokenChunk("r2", 0, [1], "decode-a")])
    with pytest.raises(token_stream.TokenStreamError, match="another worker's topic") as e:
        gate.read(topics.stream("decode-b"), forged)
    assert e.value.rids == ["r2"]
    broken = token_stream.encode("decode-b", 1.0, [TokenChunk("r1", 0, [1], "decode-b")])[:-1]
    with pytest.raises(token_stream.TokenStreamError, match="truncated") as e:
        gate.read(topics.stream("decode-b"), broken)
    assert e.value.rids == []
    routers = Tokens(rid="r2", start=0, tokens=[], worker="router", t=1.0, error="no decoder")
    assert gate.read(topics.tokens("r2"), routers.dump()) == [
        TokenChunk("r2", 0, [], "router", done=True, error="no decoder")]
    with pytest.raises(token_stream.TokenStreamError) as e:
        gate.read(topics.tokens("r2"), b'{"rid": "r2", "start": -1}')
    assert e.value.rids == ["r2"]
    gate.forget("r2")
    with pytest.raises(token_stream.TokenStreamError) as e:
        gate.read(topics.tokens("r2"), b'{"rid": "r2", "start": -1}')
    assert e.value.rids == []


def test_a_chunk_past_the_requests_length_is_dropped_and_counted() -> None:
    from testbed.deploy.run_record import ClientRecord

    rec = ClientRecord("r1", 10, 4)
    assert rec.accept(TokenChunk("r1", 2**31, [1], "decode-a"), 0.0) == 0 and rec.early == {}
    assert rec.accept(TokenChunk("r1", 2, [1, 2, 3], "decode-a"), 0.0) == 0 and rec.conflicts == 2
    assert rec.accept(TokenChunk("r1", 0, [7, 8, 9, 10], "decode-a", done=True), 0.0) == 4 and rec.ok


def test_overlapping_early_chunks_are_held_once_and_assemble_exactly() -> None:
    """A streamer sending every suffix of a request's answer before its first token (2,047
    overlapping chunks): the client holds each token once (max_new in all, not ~max_new^2/2),
    and the stream assembles exactly when the gap fills; a held chunk that disagrees is a
    conflict, not a token."""
    from testbed.deploy.run_record import ClientRecord

    n = 2048
    answer = [3 + i % 97 for i in range(n)]
    rec = ClientRecord("r1", 10, n)
    for k in range(n - 1, 0, -1):
        rec.accept(TokenChunk("r1", k, answer[k:], "decode-a", done=True), 0.0)
        assert sum(len(c.tokens) for c in rec.early.values()) <= n
    assert sum(len(c.tokens) for c in rec.early.values()) == n - 1
    assert rec.accept(TokenChunk("r1", 5, [0] * 10, "decode-b"), 0.0) == 0 and rec.conflicts == 1
    assert rec.accept(TokenChunk("r1", 0, answer[:3], "decode-a"), 0.0) == n
    assert rec.ok and rec.tokens.tolist() == answer and rec.early == {}
    # A chunk that runs into a held one continues past it (the held chunk's tail is taken).
    rec = ClientRecord("r2", 10, 8)
    rec.accept(TokenChunk("r2", 4, [5, 6, 7, 8], "decode-a", done=True), 0.0)
    assert rec.accept(TokenChunk("r2", 0, [1, 2, 3, 4, 5, 6], "decode-b"), 0.0) == 8
    assert rec.ok and rec.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_fuzzed_token_batches_decode_or_fail_with_a_reason() -> None:
    rng = random.Random(11)
    seed = token_stream.encode("decode-a", 3.0, BATCH)
    decoded = 0
    for _ in range(FUZZ_INPUTS):
        data = _mutate(rng, seed) if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 200))
        try:
            _, _, chunks = token_stream.decode(data)
        except token_stream.TokenStreamError:
            continue
        decoded += 1
        assert all(re.match(SAFE_NAME, c.rid) and c.start >= 0 and (c.error is None or c.done) for c in chunks)
    assert decoded < FUZZ_INPUTS // 2


def test_the_replay_clients_records_are_read_as_input_naming_file_line_and_field() -> None:
    """The client process runs without root; what it hands back is validated line by line
    against what was sent before the orchestrator uses any of it."""
    from testbed.deploy.run_record import ClientRecord
    from testbed.errors import TestbedError
    from testbed.load.client_process import ReplayedRequest, read_records

    rec = ClientRecord("r1", 10, 3, sent=1.0, ended=2.0, token_times=[1.5, 1.6], tokens=[4, 5], done=True,
                       workers=["decode-a"], by_worker={"decode-a": 2})
    good = ReplayedRequest.of(rec).model_dump_json()
    assert read_records(good, "records.jsonl", {"r1": 3})["r1"] == rec
    for text, why in [
        (good + "\n" + good, "records.jsonl:2: rid: r1 was already read"),
        (good, "records.jsonl:1: rid: r1 was not sent"),
        (good.replace('"tokens":[4,5]', '"tokens":[4,5,6,7]').replace('"token_times":[1.5,1.6]',
                                                                    '"token_times":[1,2,3,4]'),
         "records.jsonl:1: tokens: 4 tokens at 4 times for a request of 3"),
        (good.replace('"sent":1.0', '"sent":"soon"'), "records.jsonl:1: sent"),
        # A record's ids are 4 bytes, unsigned, as a token batch carries them.
        (good.replace('"tokens":[4,5]', '"tokens":[4,4294967296]'), "records.jsonl:1: tokens.1"),
        (good.replace('"tokens":[4,5]', '"tokens":[-1,5]'), "records.jsonl:1: tokens.0"),
        ('{"rid": ' + "[" * 5000 + "]" * 5000 + "}", "records.jsonl:1:"),
    ]:
        with pytest.raises(TestbedError, match=re.escape(why)):
            read_records(text, "records.jsonl", {"r1": 3} if "not sent" not in why else {"r2": 3})


def test_refusal_lines_are_bounded_and_say_how_many_were_left_out(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer refused 10,000 times in a burst writes at most the budget's lines (not 10,000:
    the logs live on a RAM tmpfs), and the next line printed says how many were left out."""
    from protocol import refusals

    monkeypatch.setattr(refusals, "_BUDGET", refusals._Budget())
    clock = [1000.0]
    monkeypatch.setattr(refusals.time, "monotonic", lambda: clock[0])
    refusals._BUDGET.last = clock[0]
    for i in range(10_000):
        refusals.refusal(f"w: refused a message {i}: " + "x" * 5000)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == refusals.BURST and all(len(line) <= refusals.MAX_LINE for line in lines)
    clock[0] += 1.0  # a second later: PER_S more
    refusals.refusal("w: refused one more")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"({10_000 - refusals.BURST} refusal line(s) left out: more than 50 a second)",
                     "w: refused one more"]
