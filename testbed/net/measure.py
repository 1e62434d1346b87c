"""Measurements taken from inside the namespaces: ICMP round-trip times and TCP goodput.

RTT uses a raw ICMP socket opened inside the source namespace (the destination's kernel
answers; no responder process). Goodput is a bulk TCP transfer between sockets
opened inside the two namespaces, counted at the receiver in steady state.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field

from testbed.net import netns

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
    seconds: float
    bytes: int
    error: str | None = None


CHUNK = 4 * 1024 * 1024


def _bytes_received(conn: socket.socket) -> int:
    """The kernel's count of payload bytes this TCP socket received (tcp_info.tcpi_bytes_received)."""
    info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0]


_TCPI_BYTES_RECEIVED = 128  # offset in struct tcp_info (Linux >= 4.1)


def _counter_at(conns: list[socket.socket], tries: int = 20) -> tuple[float, int]:
    """(time, bytes received) read together: the time is the middle of a read that took
    under 2 ms. A measuring thread descheduled between reading the clock and the counter
    (the delay line runs at real-time priority and can hold both cores for 100 ms and more)
    would otherwise count bytes of a longer span than it divides by: 109 % of the rate
    measured once at 500 Mbit/s."""
    for _ in range(tries):
        before = time.monotonic()
        total = sum(_bytes_received(c) for c in conns)
        after = time.monotonic()
        if after - before < 0.002:
            break
    return (before + after) / 2, total


SAMPLE_EVERY_S = 0.01


def _sample_counter(conns: list[socket.socket], until: float) -> list[tuple[float, int]]:
    """(time, bytes received) every ``SAMPLE_EVERY_S`` until ``until``."""
    samples = [_counter_at(conns)]
    while (now := time.monotonic()) < until:
        time.sleep(min(SAMPLE_EVERY_S, until - now))
        samples.append(_counter_at(conns))
    return samples


def _slope(samples: list[tuple[float, int]]) -> float:
    """Bytes per second: the least-squares slope of the counter over the window.

    Two end points alone put any burst at an edge into the figure in full: the delay line
    descheduled for 150 ms as the window opens releases those frames inside it, +7.6 % at
    500 Mbit/s in a CI run. The fitted slope weighs each edge by its share of the window
    (about a fifth of that error) and a burst in the middle not at all.
    """
    n = len(samples)
    if n < 2:
        return 0.0
    t_mean = sum(t for t, _ in samples) / n
    b_mean = sum(b for _, b in samples) / n
    var = sum((t - t_mean) ** 2 for t, _ in samples)
    cov = sum((t - t_mean) * (b - b_mean) for t, b in samples)
    return cov / var if var else 0.0


def window_for(rate_bps: float, rtt_s: float, queue_bytes: int) -> int:
    """The largest receive window a flow over a shaped line can use without loss: its
    bandwidth-delay product plus the bottleneck's buffer. A larger one overflows the buffer
    and the figure becomes how TCP recovers from losses it caused, not the line's rate."""
    return int(rate_bps / 8 * rtt_s) + queue_bytes


def goodput(src_ns: str, dst_ns: str, dst_ip: str, seconds: float = 3.0, warmup: float = 2.0,
            streams: int = 1, window_bytes: int | None = None) -> GoodputResult:
    """Bulk TCP from ``src_ns`` to ``dst_ip`` (listening in ``dst_ns``), steady state only.

    Goodput is the rate at which the kernel's count of payload bytes the receiving sockets
    took in (``tcpi_bytes_received``) grows, fitted over a window that starts after
    ``warmup`` (slow start) and lasts ``seconds``. Reading kernel counters makes the figure
    independent of when the receiving threads get the CPU, and bytes still queued when
    the sender stops are outside the window.

    ``window_bytes`` bounds the receiver's window (``window_for``), as ``iperf -w`` would: left
    to autotuning under 32 MB default buffers, a sender overshoots the bottleneck's buffer,
    loses a burst and recovers, and the receiver's in-order count then jumps by everything
    it held out of order (+26 % of 500 Mbit/s over a 2 s window; -22 % at 20 Mbit/s; at
    50 Mbit/s with 64 KB frames a third of the segments were resent and one window in
    several read 83 %).
    """
    with netns.entered(dst_ns):
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if window_bytes:  # before listen: accepted sockets inherit it, with a matching window scale
            # The kernel doubles the figure for overhead and advertises a share of that
            # (about 87 % with 64 KB frames), so the window stays just under ``window_bytes``.
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window_bytes // 2)
        lsock.bind((dst_ip, 0))
        lsock.listen(streams)
    port = lsock.getsockname()[1]
    t_start = time.monotonic()
    t_from, t_to = t_start + warmup, t_start + warmup + seconds
    conns: list[socket.socket] = []
    errors: list[str] = []

    def receive(conn: socket.socket) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        try:
            while conn.recv_into(view) and time.monotonic() < t_to + 0.2:
                pass
        except OSError as e:
            errors.append(f"receiver: {e}")

    def send(i: int) -> None:
        with netns.entered(src_ns):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        payload = memoryview(bytes(CHUNK))
        try:
            s.settimeout(warmup + seconds + 10)
            s.connect((dst_ip, port))
            while time.monotonic() < t_to + 0.3:
                s.sendall(payload)
        except OSError:
            pass  # the receiver closes first once its window is over
        finally:
            s.close()

    senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(streams)]
    for t in senders:
        t.start()
    receivers = []
    lsock.settimeout(10)
    try:
        for _ in range(streams):
            conn, _ = lsock.accept()
            conns.append(conn)
            t = threading.Thread(target=receive, args=(conn,), daemon=True)
            t.start()
            receivers.append(t)
    except OSError as e:
        errors.append(f"accept: {e}")
    finally:
        lsock.close()
    total, span, rate = 0, seconds, 0.0
    if not errors:
        time.sleep(max(0.0, t_from - time.monotonic()))
        samples = _sample_counter(conns, t_to)
        total, span = samples[-1][1] - samples[0][1], samples[-1][0] - samples[0][0]
        rate = _slope(samples)
    for t in receivers:
        t.join(timeout=warmup + seconds + 20)
    for c in conns:  # before the senders: one blocked on a full window ends at once, not at its timeout
        c.close()
    for t in senders:
        t.join(timeout=warmup + seconds + 20)
    if errors or not total:
        return GoodputResult(0.0, seconds, total, "; ".join(errors) or "no data received")
    return GoodputResult(rate * 8, span, total)
