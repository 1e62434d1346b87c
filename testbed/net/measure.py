"""Measurements taken from inside the namespaces: ICMP round-trip times and TCP goodput.

RTT uses a raw ICMP socket opened inside the source namespace (the destination's kernel
answers; no responder process). Goodput uses iperf3 (client and server started inside the
two namespaces), reading the receiver's byte count after a warm-up second is omitted.
"""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed import netns

ICMP_ECHO, ICMP_REPLY = 8, 0


@dataclass
class PingResult:
    sent: int
    rtts_ms: list[float] = field(default_factory=list)

    @property
    def received(self) -> int:
        return len(self.rtts_ms)

    @property
    def loss_pct(self) -> float:
        return 100.0 * (1 - self.received / self.sent) if self.sent else 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.rtts_ms) if self.rtts_ms else float("nan")

    @property
    def stdev_ms(self) -> float:
        return statistics.pstdev(self.rtts_ms) if len(self.rtts_ms) > 1 else 0.0

    def percentile(self, q: float) -> float:
        if not self.rtts_ms:
            return float("nan")
        s = sorted(self.rtts_ms)
        return s[min(len(s) - 1, int(q / 100 * len(s)))]


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(src_ns: str, dst_ip: str, count: int = 30, interval_s: float = 0.01,
         timeout_s: float = 2.0, payload: int = 56, warmup: int = 2) -> PingResult:
    """Send ``count`` echo requests (after ``warmup`` unrecorded ones that resolve ARP)."""
    with netns.entered(src_ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    sent_at: dict[int, float] = {}
    rtts: dict[int, float] = {}
    body = bytes(payload)
    total = warmup + count
    try:
        sock.setblocking(False)
        next_send = time.monotonic()
        seq = 0
        last_send = 0.0
        while True:
            now = time.monotonic()
            if seq < total and now >= next_send:
                hdr = struct.pack("!BBHHH", ICMP_ECHO, 0, 0, ident, seq)
                csum = _checksum(hdr + body)
                pkt = struct.pack("!BBHHH", ICMP_ECHO, 0, csum, ident, seq) + body
                sent_at[seq] = time.monotonic()
                sock.sendto(pkt, (dst_ip, 0))
                last_send = sent_at[seq]
                seq += 1
                # Warm-up probes wait for their answer so ARP is settled before measuring.
                next_send = next_send + interval_s if seq > warmup else now + 0.2
            if seq >= total and (len(rtts) >= total or now - last_send > timeout_s):
                break
            wait = max(0.0, (next_send if seq < total else last_send + timeout_s) - now)
            r, _, _ = select.select([sock], [], [], min(wait, 0.05))
            if not r:
                continue
            t = time.monotonic()
            while True:
                try:
                    data = sock.recv(65535)
                except BlockingIOError:
                    break
                ihl = (data[0] & 0x0F) * 4
                typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if typ == ICMP_REPLY and rid == ident and rseq in sent_at and rseq not in rtts:
                    rtts[rseq] = (t - sent_at[rseq]) * 1e3
    finally:
        sock.close()
    return PingResult(count, [rtts[s] for s in sorted(rtts) if s >= warmup])


@dataclass
class GoodputResult:
    bits_per_second: float
    retransmits: int
    seconds: float
    error: str | None = None


_port = 5201


def goodput(src_ns: str, dst_ns: str, dst_ip: str, seconds: float = 3.0, omit: float = 1.0,
            streams: int = 1, log_dir: Path | None = None) -> GoodputResult:
    """Bulk TCP from ``src_ns`` to ``dst_ip`` (a server started in ``dst_ns``)."""
    global _port
    _port = 5201 + (_port - 5200) % 200
    port = _port
    server = netns.spawn(dst_ns, ["iperf3", "-s", "-1", "-B", dst_ip, "-p", str(port)])
    try:
        _wait_listening(dst_ns, port, timeout=5)
        cmd = ["iperf3", "-c", dst_ip, "-p", str(port), "-t", str(seconds), "-O", str(omit),
               "-P", str(streams), "-J"]
        client = netns.spawn(src_ns, cmd, stdout=subprocess.PIPE)
        try:
            out, _ = client.communicate(timeout=seconds + omit + 20)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
            return GoodputResult(0.0, 0, seconds, "iperf3 client timed out")
        try:
            data = json.loads(out)
        except ValueError:
            return GoodputResult(0.0, 0, seconds, f"iperf3 printed no JSON: {out[:200]!r}")
        if "error" in data:
            return GoodputResult(0.0, 0, seconds, data["error"])
        end = data["end"]
        return GoodputResult(
            end["sum_received"]["bits_per_second"],
            end.get("sum_sent", {}).get("retransmits", 0),
            end["sum_received"]["seconds"],
        )
    finally:
        netns.terminate([server.pid], grace_s=1.0)


def _wait_listening(ns: str, port: int, timeout: float) -> None:
    want = f":{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with netns.entered(ns), open("/proc/thread-self/net/tcp") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[1].endswith(want) and parts[3] == "0A":  # LISTEN
                    return
        time.sleep(0.01)
    raise TimeoutError(f"iperf3 server did not listen on port {port} in {ns}")
