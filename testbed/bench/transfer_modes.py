"""``testbed bench transfer``: the KV transfer modes over the emulated line and on the link
model, side by side (``make bench-transfer``).

One prefill of N emulated tokens (4K, 16K, 64K) on the scenario's prefill device, priced by
the device model pass by pass as the workers price it (``Pacer.prefill_schedule``), and its KV
shipped across the WAN to a decoder by the workers' own wire (``kv_wire.send_kv`` between the
namespaces; ``SimTransport.send_kv`` on the link model): after the prefill, per chunk
(each pass's KV as the pass ends) or per layer (layer groups as the pass computes them), over
1 or 4 TCP connections, on an idle line and on one loaded by a bulk TCP stream from another
host of the first datacenter. The prefill is its schedule, not a model run: what is measured
is the transfer around it.

Per case: **last byte**, from the prefill's start to the decoder holding every byte of the KV
(its ``done``: every block checked and in place, END acknowledged), and what of it is left
**after the prefill** (last byte less the prefill's time: what streaming hides, or cannot).
The first decodable token is the last byte here: a decoder needs every layer of every token
before its first step. Emulated seconds (the wire's divided by the dilation).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from protocol import clock
from testbed.bench.links import PORT as LOAD_PORT
from testbed.deploy.emulation import EmulationPlan
from testbed.net import netns
from testbed.net.build import Network
from testbed.scenario import Role, Scenario
from testbed.sim.bus import SimBroker
from testbed.sim.flows import host_congestion
from testbed.sim.kv import SimNet
from testbed.sim.links import Conn
from testbed.sim.network import LinkModel
from testbed.sim.vloop import VirtualLoop
from workers import kv_wire
from workers.device import make_pacer
from workers.kv_stream import Computed
from workers.transport import KvSend

SIZES = (4096, 16384, 65536)  # emulated tokens
MODES = ("after-prefill", "per-chunk", "per-layer")
CONNECTIONS = (1, 4)
KV_PORT = 7173
LAYER_GROUPS = 4


@dataclass(frozen=True)
class Case:
    tokens: int  # emulated
    mode: str
    connections: int
    loaded: bool

    @property
    def name(self) -> str:
        return (f"{self.tokens // 1024}K {self.mode}, {self.connections} connection{'s' * (self.connections > 1)}, "
                f"{'loaded' if self.loaded else 'idle'} line")


class _Rx:
    def __init__(self) -> None:
        self.done: dict[str, float] = {}
        self.failed: dict[str, str] = {}

    async def offer(self, rid: str, tokens: list[int], ticket: str) -> int:
        return 0

    async def arrived(self, inc: kv_wire.Incoming) -> None:
        self.done[inc.request_id] = clock.monotonic()

    async def fail(self, rid: str, why: str) -> None:
        self.failed[rid] = why


def _schedule(sc: Scenario, plan: EmulationPlan, host: str, replayed: int) -> list[tuple[int, float]]:
    """The prefill's passes: (replayed tokens done by its end, real seconds from its start)."""
    pacer = make_pacer(sc.device_spec(host), plan.cost(), plan.scales)
    return pacer.prefill_schedule(replayed, 0) or [(replayed, 0.0)]


async def _one(send: Any, case: Case, rid: str, steps: list[tuple[int, float]], kv: torch.Tensor,
               t0: float) -> None:
    """The case's transfer, its prefill starting at ``t0`` (``send(rid, kv, opts)``)."""
    n = kv.shape[3]
    end = t0 + steps[-1][1]
    if case.mode == "after-prefill":
        await asyncio.sleep(max(0.0, end - clock.monotonic()))
        await send(rid, kv, KvSend(connections=case.connections, timeout_s=60.0))
        return
    computed = Computed(t0, 0, [d for d, _ in steps], [t for _, t in steps])
    groups = LAYER_GROUPS if case.mode == "per-layer" else 1
    await send(rid, kv, KvSend(connections=case.connections, timeout_s=60.0, computed=computed,
                               layer_groups=groups))
    assert n == steps[-1][0]


# ------------------------------------------------------------------ the line
def _sink(ns: str, ip: str) -> None:
    """The load's receiver (a process of its own): read whatever comes until the sender goes."""
    with netns.entered(ns):
        srv = socket.create_server((ip, LOAD_PORT), reuse_port=True)
    with srv:
        conn, _ = srv.accept()
        buf = bytearray(1 << 20)
        with conn:
            while conn.recv_into(buf):
                pass


def _source(ns: str, ip: str) -> None:
    """The load's sender (a process of its own): bytes to ``_sink`` until it is terminated."""
    with netns.entered(ns):
        s = socket.socket()
    for _ in range(50):  # the sink may still be binding
        try:
            s.connect((ip, LOAD_PORT))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    chunk = bytes(1 << 16)
    while True:
        s.sendall(chunk)


class _Load:
    """A bulk TCP stream across the line, sender and receiver each a process of its own (in
    this process their threads took the GIL from the transfer's event loop: a loaded line then
    measured the bench, not TCP). Ended by PID, and with a reset: the namespaces' socket buffers
    (32 MB) would otherwise keep the line loaded long after the case."""

    def __init__(self, src_ns: str, dst_ns: str, ip: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=_sink, args=(dst_ns, ip), daemon=True),
                      ctx.Process(target=_source, args=(src_ns, ip), daemon=True)]
        for p in self.procs:
            p.start()

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # the kernel resets its connection: nothing left queued
            p.join(5.0)


def on_line(net: Network, cases: list[Case], sender: str, loader: str, receiver: str, plan: EmulationPlan,
            kv_shape: tuple[int, int, int]) -> dict[Case, float]:
    """Each case over the built network: seconds from the prefill's start to the last byte."""
    sc, ip = net.scenario, net.ip_of(receiver)
    layers, heads, head_dim = kv_shape
    out: dict[Case, float] = {}

    async def main() -> None:
        rx = _Rx()
        server = await kv_wire.serve_kv(ip, KV_PORT, rx.offer, rx.arrived, rx.fail, netns=net.ns_of(receiver),
                                        timeout_s=60.0)
        pool = kv_wire.Connections()

        async def send(rid: str, kv: torch.Tensor, opts: KvSend) -> None:
            await kv_wire.send_kv(ip, KV_PORT, rid, list(range(kv.shape[3])), kv, 1, sc.workers.block_size,
                                  pool=pool, zeros=True, netns=net.ns_of(sender), timeout_s=opts.timeout_s,
                                  computed=opts.computed, connections=opts.connections,
                                  layer_groups=opts.layer_groups)
        try:
            for i, case in enumerate(cases):
                replayed = case.tokens // plan.scales.s_in
                kv = torch.zeros(layers, 2, heads, replayed, head_dim)
                load = _Load(net.ns_of(loader), net.ns_of(receiver), ip) if case.loaded else None
                rid = f"c{i}"
                try:
                    if load is not None:
                        await asyncio.sleep(2.0)  # the load's flow at its share before the case starts
                    t0 = clock.monotonic()
                    await _one(send, case, rid, _schedule(sc, plan, sender, replayed), kv, t0)
                    await asyncio.sleep(0.1)
                finally:
                    if load is not None:
                        load.stop()
                if rid not in rx.done:
                    raise ConnectionError(f"bench transfer, {case.name}: {rx.failed.get(rid, 'no answer')}")
                out[case] = rx.done[rid] - t0
                await asyncio.sleep(0.5)  # the line drains between cases
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    return out


# ------------------------------------------------------------------ the model
def on_model(net: Network, case: Case, sender: str, loader: str, receiver: str, plan: EmulationPlan,
             kv_shape: tuple[int, int, int]) -> float:
    loop = VirtualLoop()
    links = LinkModel(loop, net.scenario, net.plan, congestion=host_congestion())
    sim = SimNet(links, SimBroker(links, receiver))
    ip = net.ip_of(receiver)
    rx = _Rx()
    layers, heads, head_dim = kv_shape
    replayed = case.tokens // plan.scales.s_in

    async def main() -> float:
        await sim.transport(receiver).serve_kv(ip, KV_PORT, rx.offer, rx.arrived, rx.fail)
        stop = asyncio.Event()
        if case.loaded:
            load = Conn(links.path(loader, receiver))
            await asyncio.sleep(links.prepare(load))
            asyncio.ensure_future(links.send(load, 1e15, [stop]))
            await asyncio.sleep(2.0)

        async def send(rid: str, kv: torch.Tensor, opts: KvSend) -> None:
            await sim.transport(sender).send_kv(ip, KV_PORT, rid, list(range(kv.shape[3])), kv, 1,
                                                net.scenario.workers.block_size, opts)

        t0 = clock.monotonic()
        await _one(send, case, "m", _schedule(net.scenario, plan, sender, replayed),
                   torch.zeros(layers, 2, heads, replayed, head_dim), t0)
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.sleep(0.1)  # the load's flow ends
        return rx.done["m"] - t0

    try:
        with clock.installed(loop.wall, loop.time):
            return loop.run_until_complete(main())
    finally:
        loop.close()


def run_transfer_bench(net: Network, plan: EmulationPlan, kv_shape: tuple[int, int, int],
                       sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    sc = net.scenario
    a, b = net.plan.wan_between
    receiver = next(h for h in sc.hosts_with_role(Role.DECODE) if net.plan.hosts[h].dc == b)
    senders = [h for h in sc.hosts_with_role(Role.PREFILL) + sc.hosts_with_role(Role.RELAY_DECODE)
               if net.plan.hosts[h].dc == a][:2]
    if len(senders) < 2:
        raise ValueError("bench transfer needs a prefill and another host in the first datacenter")
    sender, loader = senders
    cases = [Case(n, m, k, loaded) for loaded in (False, True) for n in sizes for m in MODES for k in CONNECTIONS]
    t0 = time.monotonic()
    line = on_line(net, cases, sender, loader, receiver, plan, kv_shape)
    d = plan.dilation
    rows = []
    for case in cases:
        prefill = _schedule(sc, plan, sender, case.tokens // plan.scales.s_in)[-1][1] / d
        model = on_model(net, case, sender, loader, receiver, plan, kv_shape) / d
        rows.append({"tokens": case.tokens, "mode": case.mode, "connections": case.connections,
                     "line": "loaded" if case.loaded else "idle", "prefill_s": round(prefill, 3),
                     "last_byte_s": round(line[case] / d, 3), "model_last_byte_s": round(model, 3),
                     "after_prefill_s": round(line[case] / d - prefill, 3),
                     "model_after_prefill_s": round(model - prefill, 3)})
    s = net.plan.wan_shaping[(a, b)]
    return {"rate_mbit": (s.rate_bps or 0) / 1e6, "delay_ms": s.delay_ms, "token_scale": plan.scales.s_in,
            "dilation": d, "sender": sender, "receiver": receiver, "layer_groups": LAYER_GROUPS,
            "wall_s": round(time.monotonic() - t0, 1), "cases": rows}


def format_transfer(r: dict[str, Any]) -> str:
    lines = [f"bench transfer: WAN {r['rate_mbit']:.3g} Mbit/s (wire), {r['delay_ms']:g} ms each way, token scale "
             f"{r['token_scale']}, D {r['dilation']:g}; {r['sender']} -> {r['receiver']}; per-layer in "
             f"{r['layer_groups']} groups; emulated seconds, line / model", "",
             "| tokens | mode | conns | line | prefill s | last byte s | after the prefill s |",
             "|---:|---|---:|---|---:|---:|---:|"]
    for c in r["cases"]:
        lines.append(f"| {c['tokens'] // 1024}K | {c['mode']} | {c['connections']} | {c['line']} "
                     f"| {c['prefill_s']:.2f} | {c['last_byte_s']:.2f} / {c['model_last_byte_s']:.2f} "
                     f"| {c['after_prefill_s']:.2f} / {c['model_after_prefill_s']:.2f} |")
    lines.append(f"\n({r['wall_s']:.0f} s)")
    return "\n".join(lines)
