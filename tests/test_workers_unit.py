"""Worker building blocks without the network: cache, wire format, model, pacing."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import random
import statistics
import time

import pytest
import torch

from workers import kv_wire
from workers.event_loop import new_event_loop
from workers.model import DecodeBatch, ModelRunner, ensure_default_model
from workers.radix_cache import RadixCache


@pytest.fixture(scope="module")
def runner64() -> ModelRunner:
    return ModelRunner(ensure_default_model(), "float64")


def fake_kv(n: int, layers: int = 2, heads: int = 2, dim: int = 4, base: float = 0.0) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float64) + base
    return t.view(1, 1, 1, n, 1).expand(layers, 2, heads, n, dim).clone()


def test_radix_match_insert_lru_and_locks() -> None:
    c = RadixCache(block_size=4, capacity_tokens=16)
    a = list(range(10))
    assert c.match_prefix(a) == []
    assert c.insert(a, fake_kv(10)) == 2  # two full blocks; the partial tail is not cached
    path = c.match_prefix(a[:8] + [99, 98, 97, 96])
    assert len(path) == 2
    assert torch.equal(c.kv_of(path), fake_kv(8))  # type: ignore[arg-type]
    c.lock(path)
    b = [50 + i for i in range(12)]
    assert c.insert(b, fake_kv(12, base=100)) == 2  # capacity 4 blocks: a's 2 locked, b gets 2
    assert c.blocks == 4
    c.unlock(path)
    c.match_prefix(b)  # b is now the most recently used
    assert c.insert([7] * 8, fake_kv(8)) == 2  # evicts a's blocks (LRU), leaf first
    assert c.match_prefix(a) == []
    assert len(c.match_prefix(b)) == 2
    with pytest.raises(RuntimeError):
        c.unlock(path)


def test_radix_never_evicts_locked() -> None:
    c = RadixCache(block_size=2, capacity_tokens=4)
    c.insert([1, 2, 3, 4], fake_kv(4))
    path = c.match_prefix([1, 2, 3, 4])
    c.lock(path)
    assert c.insert([9, 9, 9, 9], fake_kv(4)) == 0
    assert c.evict(100) == 0
    assert len(c.match_prefix([1, 2, 3, 4])) == 2


def _transfer(kv: torch.Tensor, tokens: list[int], have: int, corrupt: int | None = None, frame: int = 16,
              zeros=None):
    async def main():
        got: dict[str, object] = {}

        async def offer(rid: str, toks: list[int], ticket: str) -> int:
            return have

        async def done(inc: kv_wire.Incoming) -> None:
            got["inc"] = inc

        async def fail(rid: str, msg: str) -> None:
            got["fail"] = msg

        server = await kv_wire.serve_kv("127.0.0.1", 0, offer, done, fail, zeros=zeros)
        port = server.sockets[0].getsockname()[1]
        try:
            st = await kv_wire.send_kv("127.0.0.1", port, "r1", tokens, kv, 42, 16, corrupt_block=corrupt,
                                       frame_tokens=frame)
        except kv_wire.KVTransferError as e:
            got["send_error"] = str(e)
            st = None
        await asyncio.sleep(0.05)
        server.close()
        return st, got

    return asyncio.run(main())


def test_wire_sends_only_missing_tokens_with_small_framing() -> None:
    n, have = 700, 256
    kv = torch.randn(4, 2, 2, n, 64, dtype=torch.float32)  # default model shape: 4096 B/token
    tokens = list(range(n))
    st, got = _transfer(kv, tokens, have)
    inc = got["inc"]
    assert torch.equal(inc.kv, kv[:, :, :, have:]) and inc.first_token == 42 and inc.have == have
    payload = (n - have) * 4096
    assert st.payload_bytes == payload and st.tokens_sent == n - have
    # HELLO carries the prompt's token ids (which the receiver needs for its cache).
    framing = st.bytes_sent - payload - len(str(tokens))
    assert 0 < framing <= 0.01 * payload


def test_wire_detects_corrupted_block() -> None:
    kv = torch.randn(2, 2, 2, 64, 8, dtype=torch.float64)
    st, got = _transfer(kv, list(range(64)), 0, corrupt=2)
    assert "checksum mismatch" in got["fail"]
    assert "inc" not in got
    assert "send_error" in got


def test_a_modeled_receiver_checks_every_block_but_keeps_only_a_zero_view() -> None:
    zero = torch.zeros(2, 2, 2, 256, 8, dtype=torch.float64)
    kv = torch.randn(2, 2, 2, 64, 8, dtype=torch.float64)
    st, got = _transfer(kv, list(range(64)), 16, zeros=lambda n: zero[:, :, :, :n])
    inc = got["inc"]
    assert isinstance(inc, kv_wire.Incoming) and inc.have == 16 and inc.kv.shape[3] == 48
    assert inc.kv.data_ptr() == zero.data_ptr() and not zero.any()  # a view, nothing written into it
    _, bad = _transfer(kv, list(range(64)), 0, corrupt=2, zeros=lambda n: zero[:, :, :, :n])
    assert "checksum mismatch" in bad["fail"] and "inc" not in bad


def test_batched_decode_and_extend_equal_reference(runner64: ModelRunner) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 8192) for _ in range(n)] for n in (16, 90, 333)]
    refs = [runner64.reference(p, 12) for p in prompts]
    states = []
    for p in prompts:
        kv, tok = runner64.prefill(p, None, chunk=32)  # chunked prefill
        states.append([kv, tok, [tok]])
    for _ in range(11):
        res = runner64.decode_step([(s[0], s[1]) for s in states])
        for s, (nkv, t) in zip(states, res, strict=True):
            s[0], s[1] = torch.cat([s[0], nkv], dim=3), t
            s[2].append(t)
    assert [s[2] for s in states] == refs
    kv, first = runner64.prefill(prompts[1], None, chunk=512)
    new_kv, nxt = runner64.extend(kv, refs[1][:8])  # 8 known tokens in one pass
    assert nxt[:7] == refs[1][1:8] and new_kv.shape[3] == 8


def test_decode_batch_members_join_and_leave_without_rebuilding(runner64: ModelRunner) -> None:
    """Requests join a running batch (a shorter one into a spare row; a longer one moves the
    batch's end, leaving the others a masked hole) and leave it (the last row moves into the
    freed one); every request's tokens still equal its reference; with no spare row left a
    joiner is refused (the worker rebuilds then, into the same buffers)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 8192) for _ in range(n)] for n in (40, 120, 75, 30, 200, 50)]
    refs = [runner64.reference(p, 14) for p in prompts]
    state = {}
    for i, p in enumerate(prompts):
        kv, tok = runner64.prefill(p, None, chunk=64)
        state[i] = [kv, [tok]]
    b = DecodeBatch(runner64, [state[i][0] for i in (0, 1, 2)], headroom=128, spare=2)
    rows = [0, 1, 2]

    def step() -> None:
        for i, (nkv, t) in zip(rows, b.step([state[i][1][-1] for i in rows]), strict=True):
            state[i][0] = torch.cat([state[i][0], nkv], dim=3)
            state[i][1].append(t)

    step()
    for joiner in (3, 4):  # 30 tokens: below the end; 200: past it (a hole for the others)
        assert b.fits(state[joiner][0])
        b.add(state[joiner][0])
        rows.append(joiner)
        for _ in range(3):
            step()
    assert b.holes[0] == [(124, 200)] and b.holes[4] == [] and not b.fits(state[5][0])  # no spare row
    b.remove(0)  # the last row (request 4) takes row 0
    rows[0] = rows.pop()
    for _ in range(4):
        step()
    assert b.rows == 4 and b.lens == [state[i][0].shape[3] for i in rows]
    for i in (1, 2, 3, 4):
        assert state[i][1] == refs[i][: len(state[i][1])], i
    assert len(state[1][1]) == 12 and state[0][1] == refs[0][:8]
    again = DecodeBatch(runner64, [state[i][0] for i in rows], headroom=16, reuse=b)
    assert again.bufs is b.bufs  # rebuilt into the same memory
    assert [t for _, t in again.step([state[i][1][-1] for i in rows])] == [refs[i][len(state[i][1])] for i in rows]


def test_prefill_on_cached_prefix_equals_full(runner64: ModelRunner) -> None:
    p = [random.Random(5).randrange(3, 8192) for _ in range(100)]
    full, t1 = runner64.prefill(p, None, chunk=512)
    part, t2 = runner64.prefill(p, full[:, :, :, :64], chunk=16)
    assert t1 == t2 and torch.allclose(full, part, atol=1e-10)
    # The prefix given as radix-cache blocks gives the very same result as given whole.
    blocks, t3 = runner64.prefill(p, [full[:, :, :, i : i + 16] for i in range(0, 64, 16)], chunk=16)
    assert t3 == t2 and torch.equal(blocks, part)


def test_peer_queues_take_turns_in_arrival_order_and_skip_cut_off_transfers() -> None:
    from workers.kv_queue import PeerQueues

    async def scenario(streams: int) -> tuple[list[str], int]:
        q = PeerQueues(streams)
        order: list[str] = []
        running, most = 0, 0
        cancels = {name: asyncio.Event() for name in "abcde"}

        async def transfer(name: str, peer: str = "md") -> None:
            nonlocal running, most
            if not await q.turn(peer, cancels[name]):
                order.append(f"{name}:cut")
                return
            running += 1
            most = max(most, running)
            order.append(name)
            await asyncio.sleep(0.02)
            running -= 1
            q.release(peer)

        tasks = []
        for name in "abcde":
            tasks.append(asyncio.ensure_future(transfer(name)))
            await asyncio.sleep(0.001)  # arrival order a, b, c, d, e
        assert q.waiting("md") == 5 - streams
        cancels["c"].set()  # cut off while it waits: never takes a turn, holds nothing
        await asyncio.gather(*tasks)
        other = asyncio.Event()
        assert await q.turn("other-peer", other)  # each receiver has its own queue
        return order, most

    order, most = asyncio.run(scenario(1))
    assert order == ["a", "c:cut", "b", "d", "e"] and most == 1
    order, most = asyncio.run(scenario(2))
    assert [o for o in order if o != "c:cut"] == ["a", "b", "d", "e"] and most == 2


def _refused_then_served(offer: kv_wire.OfferFn, refused: dict[str, str], served_rid: str,
                         served: dict[str, str]) -> tuple[str, dict[str, object]]:
    """A receiver of the run's token: a transfer of r1 sent with ``refused`` (it must be
    refused, failing nothing), then one of ``served_rid`` with ``served`` (it must arrive);
    the first's error and what the receiver concluded."""
    async def main() -> tuple[str, dict[str, object]]:
        got: dict[str, object] = {}

        async def done(inc: kv_wire.Incoming) -> None:
            got["inc"] = inc

        async def fail(rid: str, msg: str) -> None:
            got["fail"] = msg

        server = await kv_wire.serve_kv("127.0.0.1", 0, offer, done, fail, token="run-token")
        port = server.sockets[0].getsockname()[1]
        kv = torch.randn(2, 2, 2, 32, 8)
        try:
            with pytest.raises(kv_wire.KVTransferError) as err:
                await kv_wire.send_kv("127.0.0.1", port, "r1", list(range(32)), kv, 1, 16, **refused)  # type: ignore[arg-type]
            assert "fail" not in got
            ok = await kv_wire.send_kv("127.0.0.1", port, served_rid, list(range(32)), kv, 1, 16, **served)  # type: ignore[arg-type]
            assert ok.tokens_sent == 32
        finally:
            server.close()
        return str(err.value), got

    return asyncio.run(main())


def test_wire_refuses_a_sender_without_the_runs_token() -> None:
    async def offer(rid: str, toks: list[int], ticket: str) -> int:
        return 0

    why, got = _refused_then_served(offer, {"token": "other"}, "r2", {"token": "run-token"})
    assert why.startswith("receiver refused: ") and "KV token" in why
    assert "fail" not in got and isinstance(got["inc"], kv_wire.Incoming)  # r2 arrived, r1 failed nothing


def test_wire_refuses_a_sender_without_the_requests_ticket_and_fails_nothing() -> None:
    """A receiver that refuses the sender (``KVRefused``: no ticket for this request) tells the
    sender why and does not fail the request: its own sender, with the ticket, is then served."""
    async def offer(rid: str, toks: list[int], ticket: str) -> int:
        if ticket != "0f" * 16:
            raise kv_wire.KVRefused(f"no ticket for {rid}")
        return 0

    why, got = _refused_then_served(offer, {"token": "run-token"}, "r1", {"token": "run-token", "ticket": "0f" * 16})
    assert why == "receiver refused: no ticket for r1"
    assert "fail" not in got and isinstance(got["inc"], kv_wire.Incoming) and got["inc"].request_id == "r1"


def test_wire_keeps_a_connection_for_the_next_transfer_and_replaces_a_dead_one() -> None:
    """A sender's transfers to one receiver share one connection (no handshake, no new slow
    start); a cut-off transfer's connection is never reused; a kept connection the receiver
    closed while idle is replaced without failing the transfer."""

    async def main() -> tuple[list[str], int, int]:
        arrived: list[str] = []
        accepted = 0

        async def offer(rid: str, toks: list[int], ticket: str) -> int:
            return 0

        async def done(inc: kv_wire.Incoming) -> None:
            arrived.append(inc.request_id)

        async def fail(rid: str, msg: str) -> None:
            arrived.append(f"failed {rid}")

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            try:
                if not await kv_wire.authenticate(reader, writer, "", None):  # a connection opens with AUTH
                    return
                while await kv_wire.receive_kv(reader, writer, offer, done, fail, keep_open=True):
                    pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = kv_wire.Connections()
        kv = torch.randn(2, 2, 2, 64, 8)
        try:
            for rid in ("a", "b", "c"):
                await kv_wire.send_kv("127.0.0.1", port, rid, list(range(64)), kv, 1, 16, pool=pool)
            reused = accepted
            cancel = asyncio.Event()
            cancel.set()
            cut = await kv_wire.send_kv("127.0.0.1", port, "d", list(range(64)), kv, 1, 16, cancel=cancel, pool=pool)
            # What the peer acknowledged of this transfer alone: the kept connection carried
            # three before it (the kernel's count is the connection's whole life).
            assert cut.cancelled and cut.bytes_acked <= cut.bytes_sent, (cut.bytes_acked, cut.bytes_sent)
            await kv_wire.send_kv("127.0.0.1", port, "e", list(range(64)), kv, 1, 16, pool=pool)
            # The receiver closes every kept connection (a restart): the next transfer still arrives.
            for conns in pool._idle.values():
                for _, w in conns:
                    w.transport.abort()
            await asyncio.sleep(0.05)
            await kv_wire.send_kv("127.0.0.1", port, "f", list(range(64)), kv, 1, 16, pool=pool)
            await asyncio.sleep(0.05)
        finally:
            pool.close()
            server.close()
        return arrived, reused, accepted

    arrived, reused, accepted = asyncio.run(main())
    assert reused == 1  # three transfers, one connection
    assert [r for r in arrived if not r.startswith("failed d")] == ["a", "b", "c", "e", "f"]
    assert accepted == 3  # the cut-off closed the first; one more replaced the one closed while idle


def test_a_task_that_raises_ends_its_worker() -> None:
    """A bug in a spawned task (the decode loop, an extend) must not leave a worker that
    reports itself up and never answers: it stops, and says why."""
    from types import SimpleNamespace

    from workers.runtime import Worker

    async def main() -> Worker:
        w = object.__new__(Worker)  # no model, no broker: only the task bookkeeping is under test
        w.cfg, w.tasks, w.stopping, w.crashed = SimpleNamespace(name="decode-x"), set(), asyncio.Event(), None

        async def decode_loop() -> None:
            raise KeyError("rid-7")

        async def fine() -> None:
            return None

        w.spawn(fine())
        await asyncio.sleep(0)
        assert not w.stopping.is_set()
        w.spawn(decode_loop())
        await asyncio.wait_for(w.stopping.wait(), timeout=2)
        return w

    w = asyncio.run(main())
    assert w.crashed is not None and "decode_loop: KeyError: 'rid-7'" in w.crashed and not w.tasks


def test_the_workers_event_loop_fires_timers_within_a_millisecond_and_never_early() -> None:
    # asyncio's epoll wait rounds up to whole milliseconds: every 2.5 ms timer fired >= 0.5 ms
    # late (~2 ms here); ours sleeps the sub-millisecond rest.
    async def lateness() -> list[float]:
        out = []
        for _ in range(40):
            t0 = time.perf_counter()
            await asyncio.sleep(0.0025)
            out.append(time.perf_counter() - t0 - 0.0025)
        return out

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        late = runner.run(lateness())
    assert min(late) >= 0 and statistics.median(late) < 0.0009, late


def test_trimming_gives_freed_heap_memory_back_and_counts_it() -> None:
    """Memory freed in the middle of the heap stays resident until trimmed: a worker's RSS
    after a burst would otherwise stay at the burst's high-water mark."""
    from workers.allocator import MemoryWatch, rss_bytes

    blocks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MiB of heap chunks (under the mmap threshold)
    for b in blocks:
        b[::4096] = b"x" * 16  # resident
    kept = blocks[::100]  # pins the heap's top: free() alone cannot shrink it
    del blocks
    before = rss_bytes()
    watch = MemoryWatch()
    watch.trim()
    assert watch.trims == 1 and watch.trim_s > 0
    assert watch.released > 80 << 20 and rss_bytes() < before - (80 << 20)
    assert len(kept) == 16


def test_the_memory_floor_is_rss_net_of_the_caches_at_each_minutes_lowest() -> None:
    """A cache filling leaves the floor where it was (its bytes are subtracted); the floor
    keeps each minute's lowest value, so a burst does not raise it."""
    from workers.allocator import MemoryWatch, rss_bytes
    from workers.radix_cache import RadixCache

    # A process that ran other tests first (a parallel make test's worker runs many) holds freed
    # memory that is still resident: the KV below would reuse it and RSS not grow. Collected
    # and handed back to the kernel first, the KV's pages are new ones, as in a fresh worker.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    watch, cache = MemoryWatch(), RadixCache(4, 1 << 20)
    watch.add_holder(cache)
    watch.sample()
    base = watch.floor[-1][1]
    kv = torch.ones((2, 2, 2, 40_000, 64))  # 80 MB of KV, 10,000 blocks
    cache.insert(list(range(40_000)), kv)
    assert cache.nbytes == kv.nbytes
    del kv
    watch.sample()
    assert abs(watch.floor[-1][1] - base) < 8 << 20
    assert len(watch.floor) <= 2  # one point per minute
    cache.evict(40_000)
    assert cache.nbytes == 0 and cache.blocks == 0
    r = watch.report()
    assert r.held_bytes == 0 and r.rss_bytes > 0 and r.floor == watch.floor
    assert rss_bytes() > 0
