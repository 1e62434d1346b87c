"""``testbed bench handoff``: hand N generated tokens from the relay to the main decoder across
the emulated WAN, two ways, while other traffic loads the WAN.

(a) **KV**: ship the generated tokens' incremental KV (the KV wire format's BLOCK frames,
    block by block with checksums); the main decoder verifies and appends it.
(b) **token IDs + recompute** (PDD's extend-decode): ship the token IDs; the main decoder
    recomputes their KV in one forward pass on top of the prompt's KV.

Each repetition is timed at the relay from the first byte sent to the main decoder's
acknowledgement that the KV is in place (so both include the acknowledgement's trip back
across the WAN). Methods alternate, so both see the same background load: bulk TCP from
the prefill host to the main decoder's host over the same WAN. Connections are kept open
between repetitions, as a serving system would.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from typing import Any

import torch

from testbed.net import netns
from testbed.net.build import Network
from testbed.scenario import Role
from testbed.traces.workload import synth_tokens
from workers.kv_wire import (
    ACK,
    BLOCK,
    END,
    EXTEND,
    KVTransferError,
    decode_block,
    encode_block,
    recv_frame,
    send_frame,
)
from workers.model import ModelRunner, ensure_default_model

PORT = 7171
LOAD_PORT = 7172


class _MainDecoder(threading.Thread):
    """The receiving side, in the main decoder's namespace."""

    def __init__(self, ns: str, ip: str, runner: ModelRunner, base_kv: torch.Tensor, n_tokens: int) -> None:
        super().__init__(daemon=True, name="bench-md")
        self.ns, self.ip, self.runner, self.base_kv = ns, ip, runner, base_kv
        s = base_kv.shape
        self.buf = torch.empty((s[0], s[1], s[2], s[3] + n_tokens, s[4]), dtype=base_kv.dtype)
        self.buf[:, :, :, : s[3]] = base_kv
        self.compute_s: list[float] = []
        self.errors: list[str] = []
        with netns.entered(ns):
            self.lsock = socket.create_server((ip, PORT), backlog=4)

    def run(self) -> None:
        with netns.entered(self.ns):
            conns = [self.lsock.accept()[0] for _ in range(2)]
        threads = [threading.Thread(target=self._serve, args=(c,), daemon=True) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _serve(self, conn: socket.socket) -> None:
        n0 = self.base_kv.shape[3]
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                ftype, payload = recv_frame(conn)
                if ftype == EXTEND:
                    tokens = json.loads(payload)["tokens"]
                    t0 = time.perf_counter()
                    new_kv, _ = self.runner.extend(self.base_kv, tokens)
                    self.buf[:, :, :, n0 : n0 + len(tokens)] = new_kv
                    self.compute_s.append(time.perf_counter() - t0)
                    send_frame(conn, ACK, b"{}")
                elif ftype == BLOCK:
                    pos = n0
                    layers, _, heads, _, head_dim = self.buf.shape
                    while ftype == BLOCK:
                        blk = decode_block(payload, layers, heads, head_dim, self.buf.dtype)
                        count = blk.kv.shape[3]
                        self.buf[:, :, :, pos : pos + count] = blk.kv
                        pos += count
                        ftype, payload = recv_frame(conn)
                    if ftype != END:
                        raise ConnectionError(f"unexpected frame {ftype}")
                    send_frame(conn, ACK, b"{}")
                else:
                    return
        except (ConnectionError, OSError, KVTransferError) as e:
            if "peer closed" not in str(e):
                self.errors.append(str(e))
        finally:
            conn.close()


def _background_load(net: Network, src: str, dst: str, streams: int, stop: threading.Event) -> list[int]:
    """Bulk TCP from ``src`` to ``dst`` until ``stop``; returns bytes received per stream."""
    dst_ns, dst_ip = net.ns_of(dst), net.ip_of(dst)
    with netns.entered(dst_ns):
        lsock = socket.create_server((dst_ip, LOAD_PORT), backlog=streams)
    received = [0] * streams

    def sink(i: int) -> None:
        conn = lsock.accept()[0]
        while not stop.is_set():
            n = len(conn.recv(1 << 20))
            if not n:
                break
            received[i] += n
        conn.close()

    def source() -> None:
        with netns.entered(net.ns_of(src)):
            s = socket.create_connection((dst_ip, LOAD_PORT))
        chunk = bytes(1 << 20)
        try:
            while not stop.is_set():
                s.sendall(chunk)
        except OSError:
            pass
        s.close()

    for i in range(streams):
        threading.Thread(target=sink, args=(i,), daemon=True).start()
        threading.Thread(target=source, daemon=True).start()
    return received


def _stats(values: list[float]) -> dict[str, float]:
    ms = [1000 * v for v in values]
    return {"mean_ms": statistics.fmean(ms), "max_ms": max(ms), "min_ms": min(ms),
            "p50_ms": statistics.median(ms), "std_ms": statistics.pstdev(ms)}


def run_handoff_bench(net: Network, reps: int = 50, n_tokens: int = 100, prompt_len: int = 1024,
                      load_streams: int = 2, dtype: str = "float32") -> dict[str, Any]:
    sc = net.scenario
    relay = (sc.hosts_with_role(Role.RELAY_DECODE) or sc.hosts_with_role(Role.PREFILL))[0]
    prefill = sc.hosts_with_role(Role.PREFILL)[0]
    relay_dc = next(d for d, dc in sc.datacenters.items() if relay in dc.hosts)
    main = next(h for d, dc in sc.datacenters.items() if d != relay_dc
                for h, spec in dc.hosts.items() if spec.role == Role.DECODE)
    model = str(sc.workers.model) if sc.workers.model else str(ensure_default_model())
    runner = ModelRunner(model, dtype, sc.workers.threads)
    prompt = synth_tokens("bench-handoff", prompt_len)
    base_kv, first = runner.prefill(prompt, None, sc.workers.prefill_chunk)
    # The relay's N generated tokens, and their KV (what method (a) ships).
    tokens = [first]
    kv = base_kv
    while len(tokens) < n_tokens:
        new_kv, nxt = runner.extend(kv, tokens[-1:])
        kv = torch.cat([kv, new_kv], dim=3)
        tokens.append(nxt[-1])
    full_kv, _ = runner.extend(base_kv, tokens)  # KV of all N tokens, as the relay holds it after step N
    md = _MainDecoder(net.ns_of(main), net.ip_of(main), runner, base_kv, n_tokens)
    md.start()
    with netns.entered(net.ns_of(relay)):
        kv_sock = socket.create_connection((net.ip_of(main), PORT))
        id_sock = socket.create_connection((net.ip_of(main), PORT))
    for s in (kv_sock, id_sock):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = threading.Event()
    loaded = _background_load(net, prefill, main, load_streams, stop) if load_streams else []
    time.sleep(2.0 if load_streams else 0.0)  # let the load reach steady state
    bs = sc.workers.block_size
    times: dict[str, list[float]] = {"kv": [], "ids": []}
    payload: dict[str, int] = {}
    load_t0 = time.monotonic()
    load_b0 = sum(loaded)
    for _ in range(reps):
        # (a) incremental KV, block by block (checksummed at send time, as the worker does)
        t0 = time.perf_counter()
        sent = 0
        for idx, start in enumerate(range(0, n_tokens, bs)):
            frame, _ = encode_block(idx, start, full_kv[:, :, :, start : start + bs])
            sent += send_frame(kv_sock, BLOCK, frame)
        sent += send_frame(kv_sock, END, json.dumps({"n": n_tokens}).encode())
        recv_frame(kv_sock)
        times["kv"].append(time.perf_counter() - t0)
        payload["kv"] = sent
        # (b) token IDs, recomputed on the main decoder
        t0 = time.perf_counter()
        payload["ids"] = send_frame(id_sock, EXTEND, json.dumps({"tokens": tokens}).encode())
        recv_frame(id_sock)
        times["ids"].append(time.perf_counter() - t0)
    load_mbit = (sum(loaded) - load_b0) * 8 / (time.monotonic() - load_t0) / 1e6 if loaded else 0.0
    stop.set()
    kv_sock.close()
    id_sock.close()
    md.join(timeout=10)
    if md.errors:
        raise RuntimeError(f"main decoder side failed: {md.errors[0]}")
    fwd = sc.wan.forward
    return {
        "scenario": sc.name, "relay": relay, "main": main, "tokens": n_tokens, "prompt_tokens": prompt_len,
        "dtype": dtype, "repetitions": reps, "kv_bytes_per_token": runner.shape.kv_bytes_per_token,
        "wan": {"rate_mbit": fwd.rate_mbit, "delay_ms": fwd.delay_ms, "jitter_ms": fwd.jitter_ms},
        "background_load_mbit": load_mbit, "background_streams": load_streams,
        "kv": {"payload_bytes": payload["kv"], **_stats(times["kv"])},
        "ids": {"payload_bytes": payload["ids"], **_stats(times["ids"]),
                "recompute": _stats(md.compute_s)},
    }


def format_result(r: dict[str, Any]) -> str:
    w = r["wan"]
    lines = [
        f"handoff of {r['tokens']} tokens ({r['prompt_tokens']}-token prompt, {r['dtype']}, "
        f"{r['kv_bytes_per_token']} B/token KV), {r['relay']} -> {r['main']}, {r['repetitions']} repetitions",
        f"WAN {w['rate_mbit']} Mbit/s, {w['delay_ms']} ms one way, jitter {w['jitter_ms']} ms; background load "
        f"{r['background_load_mbit']:.0f} Mbit/s over {r['background_streams']} TCP streams",
        f"{'method':32} {'payload':>12} {'mean ms':>9} {'p50 ms':>8} {'max ms':>8} {'std ms':>8}",
    ]
    for key, label in (("kv", "(a) ship incremental KV"), ("ids", "(b) token IDs + recompute")):
        m = r[key]
        lines.append(f"{label:32} {m['payload_bytes'] / 1024:9.1f} KB {m['mean_ms']:9.1f} {m['p50_ms']:8.1f} "
                     f"{m['max_ms']:8.1f} {m['std_ms']:8.1f}")
    rc = r["ids"]["recompute"]
    lines.append(f"    recompute on the main decoder: mean {rc['mean_ms']:.1f} ms, max {rc['max_ms']:.1f} ms")
    lines.append("Times run from the first byte sent to the main decoder's acknowledgement (one WAN round trip "
                 "included in both).")
    return "\n".join(lines)
