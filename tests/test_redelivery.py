"""QoS 1 delivers at least once: a broker restart makes publishers resend what the broker
had not acknowledged, which the receiver may already have taken. Every receiver of a
repeat must leave the request as if it had come once (issue #9's broker-restart fault)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import os
import weakref
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest

from protocol.messages import CancelCmd, DecodeCmd, ExtendCmd, HandoffAck, MainPart, PrefillCmd
from protocol.token_stream import TokenChunk
from protocol.worker_config import BrokerInfo, WorkerConfig
from testbed.deploy.run_record import ClientRecord
from workers.decode import DecodeWorker
from workers.kv_wire import Incoming, KVRefused, KVTransferError
from workers.model import ensure_default_model
from workers.runtime import Worker
from workers.seq import MainState, RelayState, Seq


def _chunk(start: int, tokens: list[int], done: bool = False, worker: str = "decode-a") -> TokenChunk:
    return TokenChunk("r1", start, tokens, worker, done)


def test_client_keeps_one_ordered_stream_from_repeats_gaps_and_overlaps() -> None:
    r = ClientRecord("r1", prompt_len=4, max_new=6)
    assert r.accept(_chunk(0, [5]), 1.0) == 1
    assert r.accept(_chunk(0, [5]), 1.1) == 0  # a repeat
    assert r.accept(_chunk(2, [7]), 1.2) == 0  # past a gap: held
    assert r.accept(_chunk(1, [6]), 1.3) == 2  # the gap fills, the held chunk follows
    assert r.accept(_chunk(2, [7, 8]), 1.4) == 1  # runs past what we have: only the new tail
    assert list(r.tokens) == [5, 6, 7, 8] and list(r.token_times) == [1.0, 1.3, 1.3, 1.4] and r.conflicts == 0
    assert r.accept(_chunk(3, [9, 10], worker="decode-b"), 1.5) == 0  # disagrees at index 3
    assert list(r.tokens) == [5, 6, 7, 8] and r.conflicts == 1
    assert r.accept(_chunk(4, [10, 11], done=True, worker="decode-b"), 1.6) == 2
    assert r.ok and list(r.tokens) == [5, 6, 7, 8, 10, 11] and r.by_worker == {"decode-a": 4, "decode-b": 2}


def test_a_worker_takes_a_requests_start_command_once() -> None:
    w: Any = object.__new__(Worker)  # no model, no broker: only the dispatch filter is under test
    w.cfg, w.started, w.repeated_commands = SimpleNamespace(name="decode-x"), OrderedDict(), 0
    dec = DecodeCmd(rid="r1", prompt=[1, 2], max_new=3)
    assert Worker.first_delivery(w, dec)
    assert not Worker.first_delivery(w, dec)
    assert not Worker.first_delivery(w, DecodeCmd(rid="r1", prompt=[1, 2], max_new=3))
    assert Worker.first_delivery(w, PrefillCmd(rid="r2", prompt=[1]))
    assert Worker.first_delivery(w, ExtendCmd(rid="r1", start=0))  # idempotent where handled
    assert w.repeated_commands == 2


@pytest.fixture(scope="module")
def decoder() -> DecodeWorker:
    cfg = WorkerConfig(name="decode-b", role="decode", run_id="t", host_ip="127.0.0.1",
                       broker=BrokerInfo(host="127.0.0.1", port=1883, username="u", password="p"),
                       model_path=str(ensure_default_model()), dtype="float64")
    return DecodeWorker(cfg)


def test_main_decoder_extends_a_repeated_batch_once(decoder: DecodeWorker) -> None:
    """A repeat of an extend delivered while the original computes, or after it, must not
    append the same eager tokens twice (the KV would then be wrong)."""
    w = decoder
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    ref = w.runner.reference(prompt, 8)
    kv, first = w.runner.prefill(prompt, None, 512)
    assert first == ref[0]
    acks: list[HandoffAck] = []

    async def publish(topic: str, payload: bytes, retain: bool = False) -> None:
        acks.append(HandoffAck.model_validate_json(payload))

    async def main() -> Seq:
        w.publish = publish  # type: ignore[method-assign]
        w.emit = lambda event: None  # type: ignore[method-assign]
        w.stream = lambda *a, **k: None  # type: ignore[method-assign]
        seq = Seq("r1", prompt, 8, 0.0, main=MainState("relay"))
        seq.load(kv)
        seq.main.pred = first  # type: ignore[union-attr]
        w.held["r1"] = seq
        batch1 = ExtendCmd(rid="r1", start=0, tokens=ref[:3])
        await asyncio.gather(w.on_extend(batch1), w.on_extend(batch1))  # repeat while computing
        await w.on_extend(batch1)  # repeat afterwards
        final = ExtendCmd(rid="r1", start=3, tokens=ref[3:5], final=True)
        await asyncio.gather(w.on_extend(final), w.on_extend(final))
        await asyncio.sleep(0.05)  # the spawned acknowledgements
        return seq

    seq = asyncio.run(main())
    ms = seq.main
    assert ms is not None and ms.extended == 5 and ms.mismatches == 0
    assert seq.n == len(prompt) + 5 and seq.out == ref[:6]  # eager tokens, then the MD's own next
    assert [a.extended for a in acks] == [3]
    assert "r1" in w.running and w.extend_mismatches == 0
    w.running.clear()


def test_relay_ignores_an_ack_for_an_earlier_batch(decoder: DecodeWorker) -> None:
    w = decoder
    sent: list[int] = []

    async def main() -> None:
        async def maybe_hand_off(seq: Seq) -> None:
            sent.append(seq.relay.handed)  # type: ignore[union-attr]

        w.maybe_hand_off = maybe_hand_off  # type: ignore[method-assign]
        seq = Seq("r2", [1, 2], 8, 0.0, relay=RelayState("decode-c"))
        assert seq.relay is not None
        seq.relay.handed, seq.relay.awaiting_ack = 6, True
        w.running["r2"] = seq
        await w.on_handoff_ack(HandoffAck(rid="r2", extended=3))  # the previous batch's, again
        assert seq.relay.awaiting_ack and sent == []
        await w.on_handoff_ack(HandoffAck(rid="r2", extended=6))
        assert not seq.relay.awaiting_ack and sent == [6]
        await w.on_handoff_ack(HandoffAck(rid="r2", extended=6))  # a repeat of that one
        assert sent == [6]
        del w.running["r2"]

    asyncio.run(main())
    del w.maybe_hand_off


def test_a_repeated_decode_command_leaves_the_request_in_flight(decoder: DecodeWorker) -> None:
    """Without the start filter a second DecodeCmd replaced the waiting request whose KV
    transfer had already matched the cached prefix; the filter is in the dispatch."""
    w = decoder
    cmd = DecodeCmd(rid="r3", prompt=[1, 2, 3], max_new=2, main=MainPart(relay="relay"))
    assert w.first_delivery(cmd) and not w.first_delivery(cmd)


def test_a_decoder_counts_the_kv_it_holds_outside_its_cache(decoder: DecodeWorker) -> None:
    """What the memory floor leaves out besides the cache (``workers.allocator``): every
    sequence's buffer, counted once however many of the worker's tables hold it, and only
    where it is resident: a buffer sized for every output token holds little before they come."""
    w = decoder
    before = w.nbytes
    kv, _ = w.runner.prefill([5, 6, 7, 8, 9, 10], None, 512)
    seq = Seq("r-bytes", [5, 6, 7, 8, 9, 10], 20000, 0.0)
    seq.load(kv)
    assert seq.buf is not None
    w.running["r-bytes"] = seq
    w.admission["r-bytes"] = (seq, 0.0)  # the same sequence in two tables: counted once
    try:
        held = w.nbytes - before
        assert kv.nbytes <= held < seq.buf.nbytes / 4
        seq.buf.fill_(0)  # every page written: all of it counts (pages it shares at its ends too)
        assert 0 <= w.nbytes - before - seq.buf.nbytes <= 2 * os.sysconf("SC_PAGE_SIZE")
    finally:
        del w.running["r-bytes"], w.admission["r-bytes"]
    assert w.nbytes == before


def test_a_finished_or_cancelled_request_leaves_nothing_on_the_decoder(decoder: DecodeWorker) -> None:
    """The KV deadline (``kv_timeout_s``, minutes) holds only the request's id and ends when the
    KV arrives or the request is dropped: a deadline holding the sequence kept every finished
    request's KV in memory for the whole timeout (a soak's decoder grew by GBs)."""
    w = decoder
    prompt = [2, 7, 1, 8, 2, 8]
    kv, first = w.runner.prefill(prompt, None, 512)

    async def main() -> None:
        w.emit = lambda event: None  # type: ignore[method-assign]
        w.stream = lambda *a, **k: None  # type: ignore[method-assign]
        refs = []
        await w.handle(DecodeCmd(rid="r-arrives", prompt=prompt, max_new=1))
        refs.append(weakref.ref(w.waiting["r-arrives"]))
        await w._arrived(Incoming("r-arrives", prompt, 0, kv, first, kv.nbytes, 0.0, 0.0))  # done at once
        await w.handle(DecodeCmd(rid="r-cancelled", prompt=prompt, max_new=4))
        refs.append(weakref.ref(w.waiting["r-cancelled"]))
        await w.handle(CancelCmd(rid="r-cancelled"))
        deadlines = [t for t in w.tasks if "_kv_deadline" in t.get_coro().__qualname__]  # type: ignore[union-attr]
        await asyncio.sleep(0)
        assert len(deadlines) == 2 and all(t.cancelled() for t in deadlines)
        gc.collect()
        assert [r() for r in refs] == [None, None]  # while the loop still runs

    w.cfg = w.cfg.model_copy(update={"kv_timeout_s": 3600.0})
    asyncio.run(main())
    assert not w.waiting and not w.running


@pytest.mark.hostile
def test_kv_offered_under_tokens_that_are_not_the_requests_prompt_is_refused(decoder: DecodeWorker) -> None:
    """The decoder caches KV under the HELLO's tokens: a sender naming a waiting request but
    other tokens (a poisoned prefix cache) is refused with the reason; the request's own
    prompt is still offered."""
    w = decoder
    prompt = [3, 1, 4, 1, 5, 9]

    async def main() -> str:
        w.emit = lambda event: None  # type: ignore[method-assign]
        w.stream = lambda *a, **k: None  # type: ignore[method-assign]
        await w.handle(DecodeCmd(rid="r-poison", prompt=prompt, max_new=2))
        with pytest.raises(KVTransferError) as refused:
            await w._offer("r-poison", [3, 1, 4, 1, 5, 8], "")
        with pytest.raises(KVTransferError):
            await w._offer("r-poison", prompt[:4], "")
        assert await w._offer("r-poison", list(prompt), "") >= 0
        await w.handle(CancelCmd(rid="r-poison"))
        return str(refused.value)

    why = asyncio.run(main())
    assert "the KV offered for r-poison is of 6 tokens that are not its prompt" in why


@pytest.mark.hostile
def test_kv_offered_without_the_requests_ticket_is_refused_and_the_request_waits_on(decoder: DecodeWorker) -> None:
    """Every worker of a run holds the run's KV token; the ticket in a decoder's command (the
    router's, given to that request's prefill alone besides) is what makes a HELLO this
    request's. A sender without it, even with the exact prompt, is refused (``KVRefused``: the
    request is not failed for it) and the request's own sender is still served."""
    w = decoder
    prompt = [2, 7, 1, 8, 2, 8, 1, 8]
    ticket = "5e" * 16
    logged = io.StringIO()

    async def main() -> list[str]:
        w.emit = lambda event: None  # type: ignore[method-assign]
        w.stream = lambda *a, **k: None  # type: ignore[method-assign]
        await w.handle(DecodeCmd(rid="r-ticket", prompt=prompt, max_new=2, ticket=ticket))
        whys = []
        for wrong in ("", "5e" * 15, "ab" * 16):
            with pytest.raises(KVRefused) as refused:
                await w._offer("r-ticket", list(prompt), wrong)
            whys.append(str(refused.value))
        assert "r-ticket" in w.waiting  # nothing was failed
        assert await w._offer("r-ticket", list(prompt), ticket) >= 0
        await w.handle(CancelCmd(rid="r-ticket"))
        return whys

    with contextlib.redirect_stderr(logged):
        whys = asyncio.run(main())
    assert all("does not carry the ticket" in why for why in whys), whys
    assert logged.getvalue().count("refused KV for r-ticket: its HELLO does not carry the request's ticket") == 3
