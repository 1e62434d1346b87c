"""The KV wire waits for no peer forever (loopback, no root): a silent sender or receiver
breaks its transfer within the timeout, idle connections are closed and probed, a receiver
serves a bounded number of connections, and a HELLO for a request the decoder does not
expect is refused without holding anything."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import torch

from workers import kv_wire
from workers.expected import Expected
from workers.kv_wire import AUTH, HDR, HELLO, MAGIC, VERSION

pytestmark = pytest.mark.hostile

T = 0.3  # the wire's timeout in these tests (seconds)


def _frame(ftype: int, payload: bytes) -> bytes:
    return HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)) + payload


class _Receiver:
    """A ``serve_kv`` on loopback that records what it concluded."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.failed: dict[str, str] = {}

    async def offer(self, rid: str, tokens: list[int], ticket: str) -> int:
        return 0

    async def arrived(self, inc: kv_wire.Incoming) -> None:
        self.done.append(inc.request_id)

    async def fail(self, rid: str, why: str) -> None:
        self.failed[rid] = why

    async def start(self, **kw: object) -> tuple[asyncio.Server, int]:
        server = await kv_wire.serve_kv("127.0.0.1", 0, self.offer, self.arrived, self.fail, **kw)  # type: ignore[arg-type]
        return server, server.sockets[0].getsockname()[1]


def test_a_sender_gone_silent_mid_transfer_fails_it_within_the_timeout() -> None:
    """As when a cut-off's reset is lost on a line that is down: the receiver stops waiting,
    fails the request with a reason and frees the connection."""

    async def main() -> tuple[_Receiver, float, bytes]:
        rx = _Receiver()
        server, port = await rx.start(timeout_s=T)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            hello = {"rid": "r1", "tokens": list(range(3, 35)), "dtype": "torch.float32", "layers": 2,
                     "kv_heads": 2, "head_dim": 4, "block_size": 16}
            writer.write(_frame(kv_wire.AUTH, b"{}") + _frame(HELLO, json.dumps(hello).encode()))
            t0 = time.monotonic()
            await reader.readexactly(HDR.size)  # the OFFER's header: then silence
            reply = await asyncio.wait_for(reader.read(), timeout=5 * T)  # the rest, to the receiver's close
            took = time.monotonic() - t0
            writer.close()
        finally:
            server.close()
        return rx, took, reply

    rx, took, reply = asyncio.run(main())
    assert T <= took < T + 1.0, took
    assert rx.done == [] and "nothing from the peer for 0.3 s" in rx.failed["r1"], rx.failed
    assert b"nothing from the peer" in reply  # the sender is told why, if it still listens


def test_a_receiver_that_answers_nothing_fails_the_send_within_the_timeout() -> None:
    async def main() -> tuple[str, float]:
        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            await asyncio.sleep(10)

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        try:
            with pytest.raises(kv_wire.KVTransferError) as err:
                await kv_wire.send_kv("127.0.0.1", port, "r1", list(range(32)), torch.zeros(2, 2, 2, 32, 4), 1, 16,
                                      timeout_s=T)
        finally:
            server.close()
        return str(err.value), time.monotonic() - t0

    why, took = asyncio.run(main())
    assert "nothing from the peer" in why and T <= took < T + 1.0, (why, took)


def test_kept_connections_are_probed_closed_when_idle_and_the_next_transfer_still_arrives() -> None:
    async def main() -> tuple[_Receiver, tuple[int, int, int]]:
        rx = _Receiver()
        server, port = await rx.start(timeout_s=T)
        pool = kv_wire.Connections()
        kv = torch.zeros(2, 2, 2, 32, 4)
        try:
            await kv_wire.send_kv("127.0.0.1", port, "a", list(range(32)), kv, 1, 16, pool=pool, timeout_s=T)
            (conns,) = pool._idle.values()
            sock = conns[0][1].get_extra_info("socket")
            opts = (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
            await asyncio.sleep(kv_wire.IDLE_FACTOR * T + 0.3)  # the receiver closes the idle connection
            assert conns[0][0].at_eof()
            await kv_wire.send_kv("127.0.0.1", port, "b", list(range(32)), kv, 1, 16, pool=pool, timeout_s=T)
        finally:
            pool.close()
            server.close()
        return rx, opts

    rx, opts = asyncio.run(main())
    assert rx.done == ["a", "b"] and rx.failed == {}
    assert opts == (1, 4, int(T * 1000))


def test_a_receiver_serves_a_bounded_number_of_connections() -> None:
    async def main() -> tuple[bytes, _Receiver]:
        rx = _Receiver()
        server, port = await rx.start(timeout_s=5.0, max_connections=2)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _, w in held:  # senders of the run: they hold authenticated slots
                w.write(_frame(AUTH, b'{"token": ""}'))
            await asyncio.sleep(0.05)
            r3, w3 = await asyncio.open_connection("127.0.0.1", port)
            w3.write(_frame(AUTH, b'{"token": ""}'))
            refused = await asyncio.wait_for(r3.read(), timeout=2)  # told why, then closed
            w3.close()
            held[0][1].close()
            await asyncio.sleep(0.05)
            await kv_wire.send_kv("127.0.0.1", port, "ok", list(range(32)), torch.zeros(2, 2, 2, 32, 4), 1, 16,
                                  timeout_s=5.0)
            for _, w in held[1:]:
                w.close()
        finally:
            server.close()
        return refused, rx

    refused, rx = asyncio.run(main())
    assert b"2 connections already open" in refused
    assert rx.done == ["ok"]


def test_silent_connections_hold_a_few_slots_of_their_own_and_never_a_senders() -> None:
    """300 connections that never authenticate (a stranger on the emulated network): at most
    ``MAX_UNAUTHENTICATED`` are kept (the oldest closed for each new one), none counts against
    the senders' slots, and a transfer of the run goes through meanwhile."""
    async def main() -> tuple[_Receiver, int, int]:
        rx = _Receiver()
        server, port = await rx.start(timeout_s=30.0, max_connections=4)
        try:
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
            for _ in range(100):  # (a loaded host: until the receiver has closed what it would)
                await asyncio.sleep(0.05)
                if sum(r.at_eof() for r, _ in silent) >= 300 - kv_wire.MAX_UNAUTHENTICATED:
                    break
            closed = sum(r.at_eof() for r, _ in silent)
            await kv_wire.send_kv("127.0.0.1", port, "ok", list(range(32)), torch.zeros(2, 2, 2, 32, 4), 1, 16,
                                  timeout_s=5.0)
            late = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
            for _ in range(100):
                await asyncio.sleep(0.05)
                if sum(not r.at_eof() for r, _ in silent + late) <= kv_wire.MAX_UNAUTHENTICATED:
                    break
            still_open = sum(not r.at_eof() for r, _ in silent + late)
            for _, w in silent + late:
                w.close()
        finally:
            server.close()
        return rx, closed, still_open

    rx, closed, still_open = asyncio.run(main())
    assert rx.done == ["ok"]
    assert closed >= 300 - kv_wire.MAX_UNAUTHENTICATED and still_open <= kv_wire.MAX_UNAUTHENTICATED


def test_a_hello_for_an_unknown_or_ended_request_is_refused_and_leaves_nothing() -> None:
    async def main() -> None:
        exp = Expected()
        t0 = time.monotonic()
        assert await exp.wait("stranger", T) == f"no command for it within {T:g} s"
        assert T <= time.monotonic() - t0 < T + 0.5 and "stranger" not in exp._known
        exp.expect("r1")
        assert await exp.wait("r1", T) is None and "r1" in exp
        exp.forget("r1")
        t0 = time.monotonic()
        assert await exp.wait("r1", T) == "it already ended here" and time.monotonic() - t0 < 0.05
        # The command a little after its KV's HELLO (they take different paths): served.
        waiting = asyncio.create_task(exp.wait("r2", 5 * T))
        await asyncio.sleep(0.05)
        exp.expect("r2")
        assert await waiting is None
        for i in range(5000):
            exp.forget(f"old{i}")
        assert len(exp._ended) <= 4096

    asyncio.run(main())


def test_a_connection_is_refused_unless_its_first_small_frame_carries_the_runs_token() -> None:
    """A stranger announcing a 12 MB HELLO, one with a wrong token, and one saying nothing are
    refused after a few hundred bytes at most and within the AUTH timeout (here the transfer
    timeout, 1 s, which is shorter), told why; the run's own sender (AUTH first, on each fresh
    connection) is served, and a refusal fails nothing."""
    async def main() -> tuple[list[tuple[bytes, float]], _Receiver]:
        rx = _Receiver()
        server, port = await rx.start(timeout_s=1.0, token="s3cret")
        answers = []
        try:
            for first in (HDR.pack(MAGIC, VERSION, HELLO, 0, kv_wire.MAX_HELLO),  # a HELLO first, 12 MB announced
                          _frame(kv_wire.AUTH, json.dumps({"token": "guess"}).encode()),
                          _frame(kv_wire.AUTH, b"x" * 600),  # more than MAX_AUTH
                          b""):  # silent
                r, w = await asyncio.open_connection("127.0.0.1", port)
                t0 = time.monotonic()
                w.write(first)
                answers.append((await asyncio.wait_for(r.read(), timeout=3.0),
                                time.monotonic() - t0))
                w.close()
            await kv_wire.send_kv("127.0.0.1", port, "ok", list(range(32)), torch.zeros(2, 2, 2, 32, 4), 1, 16,
                                  token="s3cret", timeout_s=1.0)
        finally:
            server.close()
        return answers, rx

    answers, rx = asyncio.run(main())
    (hello, _), (wrong, _), (big, _), (silent, waited) = answers
    assert b"announces 12583936 bytes (at most 512 expected)" in hello, hello  # refused on its header
    assert b"this run's KV token" in wrong and b"at most 512" in big, answers
    assert b"nothing from the peer for 1 s" in silent and waited < 2.0
    assert rx.done == ["ok"] and rx.failed == {}
