"""One KV transfer over several TCP connections (``kv_connections``, ``workers/kv_stripes.py``),
on loopback without root: the KV arrives exactly, kept connections are reused, a cut-off resets
every connection; a receiver that cannot take several gets one; and the receiver trusts no
joining connection: an unknown key is a stranger (nothing failed), a key used to join twice, a
block sent twice or a block cut across its whole blocks fails that transfer with a reason."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from testbed.bench import transfer_modes
from testbed.deploy.emulation import EmulationPlan
from testbed.net.plan import make_plan
from testbed.scenario import load_scenario
from testbed.sim.bus import SimBroker
from testbed.sim.kv import SimNet
from testbed.sim.network import LinkModel
from testbed.sim.vloop import VirtualLoop
from workers import kv_wire
from workers.kv_stream import Computed
from workers.kv_wire import AUTH, BLOCK, END, HDR, HELLO, JOIN, MAGIC, OFFER, VERSION, encode_block
from workers.model import ensure_default_model
from workers.model_dir import kv_bytes_per_token, kv_dims, read_config
from workers.transport import KvSend

from .conftest import ROOT, small_wan

T = 2.0


class _Receiver:
    def __init__(self, have: int = 0) -> None:
        self.have = have
        self.done: list[kv_wire.Incoming] = []
        self.failed: dict[str, str] = {}
        self.connections = 0

    async def offer(self, rid: str, tokens: list[int], ticket: str) -> int:
        return self.have

    async def arrived(self, inc: kv_wire.Incoming) -> None:
        self.done.append(inc)

    async def fail(self, rid: str, why: str) -> None:
        self.failed[rid] = why

    async def start(self, **kw: Any) -> tuple[asyncio.Server, int]:
        server = await kv_wire.serve_kv("127.0.0.1", 0, self.offer, self.arrived, self.fail, timeout_s=T, **kw)
        return server, server.sockets[0].getsockname()[1]


def _kv(n: int) -> torch.Tensor:
    return torch.randn(3, 2, 2, n, 8, dtype=torch.float32)


def test_a_transfer_over_four_connections_arrives_exactly_and_keeps_its_connections() -> None:
    kv = _kv(200)

    async def main() -> tuple[_Receiver, list[kv_wire.TransferStats], int]:
        rx = _Receiver(have=32)
        server, port = await rx.start(state_bytes=1000)
        pool = kv_wire.Connections()
        try:
            stats = [await kv_wire.send_kv("127.0.0.1", port, f"r{i}", list(range(200)), kv, 7, 16, pool=pool,
                                           timeout_s=T, state_bytes=1000, connections=4, frame_tokens=16)
                     for i in range(2)]
            idle = len(pool._idle[("127.0.0.1", port)])
        finally:
            pool.close()
            server.close()
        return rx, stats, idle

    rx, stats, idle = asyncio.run(main())
    assert rx.failed == {} and [i.request_id for i in rx.done] == ["r0", "r1"]
    for inc in rx.done:
        assert inc.have == 32 and inc.first_token == 7 and torch.equal(inc.kv, kv[:, :, :, 32:])
    first, second = stats
    assert first.tokens_sent == second.tokens_sent == 168 and first.planned_payload == 168 * 3 * 2 * 2 * 8 * 4 + 1000
    assert idle == 4  # the first connection and three that joined, all kept
    assert second.bytes_sent < first.bytes_sent  # the second opened nothing: no AUTH on any connection
    assert rx.done[1].bytes_received == second.bytes_sent  # what the receiver read is what was sent, every frame


def test_kv_streamed_over_four_connections_waits_for_each_frames_tokens() -> None:
    kv = _kv(160)

    async def main() -> tuple[_Receiver, float, float]:
        rx = _Receiver()
        server, port = await rx.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        computed = Computed(t0, 0, done=[80, 160], at=[0.2, 0.4])  # two passes
        try:
            await kv_wire.send_kv("127.0.0.1", port, "s", list(range(160)), kv, 1, 16, timeout_s=T,
                                  connections=4, computed=computed)
        finally:
            server.close()
        return rx, loop.time() - t0, rx.done[0].end - rx.done[0].start if rx.done else 0.0

    rx, took, _ = asyncio.run(main())
    assert rx.failed == {} and torch.equal(rx.done[0].kv, kv)
    assert 0.4 <= took < 1.5  # the last frames waited for the second pass


def test_a_receiver_that_takes_one_connection_gets_one() -> None:
    kv = _kv(64)

    async def main() -> _Receiver:
        rx = _Receiver()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await kv_wire.receive_kv(r, w, rx.offer, rx.arrived, rx.fail, timeout_s=T)  # no joins: one connection

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with asyncio.timeout(5):
                # No AUTH on this bare server: the first frame it reads is the HELLO.
                r, w = await asyncio.open_connection("127.0.0.1", port)
                await kv_wire._send((r, w), "127.0.0.1", port, "one", list(range(64)), kv, 3, 16, None, None, None,
                                    16, "", "", None, False, False, T, connections=4)
        finally:
            server.close()
        return rx

    rx = asyncio.run(main())
    assert rx.failed == {} and torch.equal(rx.done[0].kv, kv)


def test_a_cut_off_resets_every_connection_of_the_transfer() -> None:
    kv = _kv(4096)

    async def main() -> tuple[_Receiver, kv_wire.TransferStats]:
        rx = _Receiver()
        server, port = await rx.start()
        cancel = asyncio.Event()
        computed = Computed(asyncio.get_running_loop().time(), 0, done=[64, 4096], at=[0.0, 30.0])
        asyncio.get_running_loop().call_later(0.3, cancel.set)
        try:
            st = await kv_wire.send_kv("127.0.0.1", port, "cut", list(range(4096)), kv, 1, 16, timeout_s=T,
                                       connections=4, computed=computed, cancel=cancel)
            await asyncio.sleep(0.3)
        finally:
            server.close()
        return rx, st

    rx, st = asyncio.run(main())
    assert st.cancelled and st.tokens_sent == 64 and 0 < st.bytes_acked <= st.bytes_sent
    assert rx.done == [] and "cut" in rx.failed  # the receiver saw its transfer end unfinished


def _frame(ftype: int, payload: bytes) -> bytes:
    return HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)) + payload


async def _read(r: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    hdr = await asyncio.wait_for(r.readexactly(HDR.size), 3)
    _, _, ftype, _, n = HDR.unpack(hdr)
    return ftype, json.loads(await r.readexactly(n))


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(_frame(AUTH, b'{"token": ""}'))
    return r, w


def _hostile(side_frames: list[list[bytes]], join_key: str | None = None) -> tuple[_Receiver, list[Any]]:
    """A sender of our own making: HELLO for 64 tokens over up to 4 connections, then each
    further connection JOINs (with the OFFER's key, or ``join_key``) and sends its frames."""
    kv = _kv(64)
    hello = {"rid": "h", "tokens": list(range(64)), "dtype": "torch.float32", "layers": 3, "kv_heads": 2,
             "head_dim": 8, "block_size": 16, "stripes": 4}

    async def main() -> tuple[_Receiver, list[Any]]:
        rx = _Receiver()
        server, port = await rx.start()
        answers: list[Any] = []
        try:
            r, w = await _connect(port)
            w.write(_frame(HELLO, json.dumps(hello).encode()))
            ftype, offer = await _read(r)
            assert ftype == OFFER and "key" in offer, offer
            for frames in side_frames:
                sr, sw = await _connect(port)
                sw.write(_frame(JOIN, json.dumps({"key": join_key or offer["key"], "stripe": 1}).encode()))
                answers.append(await _read(sr))
                for f in frames:
                    sw.write(f)
                await asyncio.sleep(0.1)
            w.write(_frame(BLOCK, encode_block(0, 0, kv[:, :, :, 0:16])[0]))
            w.write(_frame(END, b'{"first_token": 1, "n": 64}'))
            answers.append(await _read(r))
        finally:
            server.close()
        return rx, answers

    return asyncio.run(main())


@pytest.mark.hostile
def test_a_joining_connection_with_an_unknown_key_is_a_stranger_and_fails_nothing() -> None:
    rx, answers = _hostile([[]], join_key="0" * 32)
    refused, *_ = answers
    assert refused[0] == kv_wire.ACK and "no transfer in progress" in refused[1]["error"]
    assert "h" not in rx.failed or "did not come" in rx.failed["h"]  # only its own sender's silence fails it


@pytest.mark.hostile
@pytest.mark.parametrize("frames,why", [
    ("twice", "joined twice"),
    ("repeat", "came twice"),
    ("ragged", "is not whole blocks"),
])
def test_a_joining_connection_that_breaks_a_rule_fails_its_transfer(frames: str, why: str) -> None:
    kv = _kv(64)
    block = _frame(BLOCK, encode_block(1, 16, kv[:, :, :, 16:32])[0])
    sides = {"twice": [[], []], "repeat": [[block, block]],
             "ragged": [[_frame(BLOCK, encode_block(1, 20, kv[:, :, :, 20:28])[0])]]}[frames]
    rx, answers = _hostile(sides)
    assert rx.done == [] and why in rx.failed.get("h", ""), rx.failed
    assert answers[-1][0] == kv_wire.ACK and why in answers[-1][1]["error"]


# ------------------------------------------------------------------ the simulator
def _sim(sends: list[tuple[str, int]], rate_mbit: float = 100.0, n: int = 2048,
         groups: int = 1) -> tuple[list[kv_wire.TransferStats], list[float]]:
    """Transfers from ha to hc over the link model, all started at 0, each (request id,
    connections): their stats and when each ended (virtual seconds)."""
    sc = small_wan(15.0, rate_mbit)
    loop = VirtualLoop()
    links = LinkModel(loop, sc, make_plan(sc, "t"), congestion="bbr")
    net = SimNet(links, SimBroker(links, "hb"))
    rx = _Receiver()
    ip = next(h.ip for h in links.plan.hosts.values() if h.name == "hc")
    kv = torch.zeros(3, 2, 2, n, 8)

    async def main() -> tuple[list[kv_wire.TransferStats], list[float]]:
        await net.transport("hc").serve_kv(ip, 7000, rx.offer, rx.arrived, rx.fail)

        async def one(rid: str, k: int) -> tuple[kv_wire.TransferStats, float]:
            computed = Computed(loop.time(), 0, (n,), (0.2,)) if groups > 1 else None  # streamed per layer
            st = await net.transport("ha").send_kv(ip, 7000, rid, list(range(1000, 1000 + n)), kv, 5, 16,
                                                   KvSend(connections=k, token="tk", layer_groups=groups,
                                                          computed=computed))
            return st, loop.time()

        out = await asyncio.gather(*(one(rid, k) for rid, k in sends))
        return [st for st, _ in out], [t for _, t in out]

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("connections,groups", [(4, 1), (1, 3), (4, 3)])
def test_the_simulator_sends_the_wires_bytes(connections: int, groups: int) -> None:
    """The same transfer on the wire and on the link model: frame for frame the same bytes
    (AUTH, HELLO with its stripes and layer groups, the blocks over four connections, each one's
    AUTH, JOIN and END, or per layer group; token ids of four digits each, which the simulator
    sizes the HELLO by exactly)."""
    kv = torch.zeros(3, 2, 2, 2048, 8)

    async def wire() -> kv_wire.TransferStats:
        rx = _Receiver()
        server, port = await rx.start(token="tk")
        computed = Computed(asyncio.get_running_loop().time(), 0, (2048,), (0.2,)) if groups > 1 else None
        try:
            return await kv_wire.send_kv("127.0.0.1", port, "w", list(range(1000, 3048)), kv, 5, 16, timeout_s=T,
                                         connections=connections, token="tk", layer_groups=groups, computed=computed)
        finally:
            server.close()

    real = asyncio.run(wire())
    (sim,), _ = _sim([("w", connections)], groups=groups)
    assert real.bytes_sent == sim.bytes_sent and real.payload_bytes == sim.payload_bytes


def test_four_connections_take_four_shares_of_a_contended_line() -> None:
    """Two equal transfers of ~6 s of the line at once: over one connection each they end about
    together; when one uses four, it takes about four fifths of the line while both run (ideal:
    done at 5/8 of the pair's time, plus slow start) and ends well before the other."""
    _, alone = _sim([("a", 1), ("b", 1)], rate_mbit=10.0, n=20480)
    (four, one), (t4, t1) = _sim([("a", 4), ("b", 1)], rate_mbit=10.0, n=20480)
    assert not four.cancelled and four.tokens_sent == one.tokens_sent == 20480
    assert abs(alone[0] - alone[1]) < 0.2 * max(alone), alone  # one connection each: shared about evenly
    assert 0.6 * t1 < t4 < 0.72 * t1, (t4, t1)  # the four-connection transfer is done first, by far
    assert t1 == pytest.approx(max(alone), rel=0.1)  # and the line's work is the same


def test_the_transfer_bench_models_each_mode_as_the_modes_say() -> None:
    """``testbed bench transfer``'s model side on two-dc.yaml's line (token scale 16): a 64K
    prompt's KV after the prefill, per chunk and per layer, on an idle and a loaded line, over 1
    and 4 connections: streaming hides the prefill, a loaded line takes longer, and on it four
    connections take four shares of five."""
    sc = load_scenario(ROOT / "topologies/two-dc.yaml")
    plan = EmulationPlan.make(sc, 16, 1.0, kv_bytes_per_token(ensure_default_model(), sc.workers.dtype))
    wire = plan.wire_scenario(sc)
    net_plan = make_plan(wire, "t")
    net = SimpleNamespace(scenario=wire, plan=net_plan, ip_of=lambda h: net_plan.hosts[h].ip)
    shape = kv_dims(read_config(ensure_default_model()))
    hosts = ("prefill", "relay", "decode-b")
    last = {(m, k, loaded): transfer_modes.on_model(net, transfer_modes.Case(65536, m, k, loaded), *hosts, plan,
                                                    shape)  # type: ignore[arg-type]
            for m in transfer_modes.MODES for k in (1, 4) for loaded in (False, True)}
    prefill = transfer_modes._schedule(wire, plan, "prefill", 4096)[-1][1]
    idle = {m: last[(m, 1, False)] for m in transfer_modes.MODES}
    assert idle["per-chunk"] < idle["after-prefill"] - 0.5 * prefill and idle["per-layer"] <= idle["per-chunk"]
    for m in transfer_modes.MODES:
        assert last[(m, 1, True)] > 1.3 * last[(m, 1, False)]  # a bulk flow holds half the line
        assert last[(m, 4, True)] < 0.85 * last[(m, 1, True)]  # four flows of five beside it
