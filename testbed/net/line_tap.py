"""KV as it crosses the line: the delay line's tap on one direction's output port.

The direction's rate limiter (htb) sits on the egress of its output port, and the kernel hands
a frame to packet taps as it dequeues it for the wire, so a packet socket on that port sees
each frame when it crossed. A classic BPF filter keeps only outgoing frames, cut to their
headers in the kernel; ``KvTap`` reads them with the kernel's time stamps (when it reads does
not matter, only that it reads before the socket's buffer fills) and bins, per ``KV_BIN_S``
of the wall clock, the TCP payload of KV connections (``kv_ports``) the first time it crosses:
a sequence range crossing again (a retransmission, a tail-loss probe) is counted apart, as
``resent``, so the bins sum to what the receivers got (counted whole, small runs' lines
carried 1.3-1.5 % more than was acknowledged).
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
import time
from array import array

KV_BIN_S = 0.02  # wall seconds per bin
TAP_SNAP = 128  # bytes of each frame read: its Ethernet, IP and TCP headers
# Frames read per turn of the delay line's loop: ~100 us, so a frame due meanwhile waits little.
TAP_BATCH = 64
SOL_PACKET, PACKET_OUTGOING, PACKET_STATISTICS = 263, 4, 6
SO_ATTACH_FILTER, SO_RCVBUFFORCE = 26, 33
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
ANC_SIZE = socket.CMSG_SPACE(16)
ETH_P_ALL = 0x0003
BPF_LD, BPF_W, BPF_ABS, BPF_JMP, BPF_JEQ, BPF_K, BPF_RET = 0x00, 0x00, 0x20, 0x05, 0x10, 0x00, 0x06
SKF_AD_PKTTYPE = 0xFFFFF000 + 4  # SKF_AD_OFF + SKF_AD_PKTTYPE: the frame's packet type, not its bytes
ETH_P_IP = b"\x08\x00"
IPPROTO_TCP = 6
SEQ_SPACE = 1 << 32
TAP_BUF = 16 * 1024 * 1024


def kv_segment(frame: bytes, ports: frozenset[int]) -> tuple[tuple[bytes, int], int, int] | None:
    """A TCP segment to or from one of ``ports``: (its connection, the sequence number after
    its payload, the payload's length); None for any other frame."""
    if len(frame) < 54 or frame[12:14] != ETH_P_IP or frame[23] != IPPROTO_TCP:
        return None
    ihl = (frame[14] & 0x0F) * 4
    o = 14 + ihl
    if len(frame) < o + 14:
        return None
    sport, dport = (frame[o] << 8) | frame[o + 1], (frame[o + 2] << 8) | frame[o + 3]
    if sport not in ports and dport not in ports:
        return None
    payload = max(0, ((frame[16] << 8) | frame[17]) - ihl - (frame[o + 12] >> 4) * 4)
    seq = int.from_bytes(frame[o + 4:o + 8], "big")
    return (frame[26:34], sport << 16 | dport), (seq + payload) % SEQ_SPACE, payload


def tcp_payload(frame: bytes, ports: frozenset[int]) -> int:
    """The TCP payload bytes of a frame to or from one of ``ports`` (0 for any other frame)."""
    seg = kv_segment(frame, ports)
    return seg[2] if seg else 0


def open_tap(ifname: str) -> socket.socket:
    """A packet socket that reads the headers of every frame leaving ``ifname``."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    prog = struct.pack("HBBI" * 4,
                       BPF_LD | BPF_W | BPF_ABS, 0, 0, SKF_AD_PKTTYPE,  # A = the frame's packet type
                       BPF_JMP | BPF_JEQ | BPF_K, 0, 1, PACKET_OUTGOING,  # outgoing?
                       BPF_RET | BPF_K, 0, 0, TAP_SNAP,  # keep its headers
                       BPF_RET | BPF_K, 0, 0, 0)  # drop the rest
    insns = ctypes.create_string_buffer(prog)
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", 4, ctypes.addressof(insns)))
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, TAP_BUF)  # root: past rmem_max
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TAP_BUF)
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


class _Seen:
    """The sequence ranges of one connection's direction that have crossed, unwrapped from
    TCP's 32 bits around the furthest end seen, as few disjoint ranges (holes close as the
    segments that fill them cross; frames do not always cross in sequence order)."""

    MAX_RANGES = 64

    def __init__(self, end32: int, when: float = 0.0) -> None:
        self.furthest = end32
        self.ranges: list[list[int]] = []  # [start, end), sorted, disjoint
        self.last = when  # when a segment of it last crossed

    def add(self, end32: int, payload: int) -> int:
        """Record a segment ending at ``end32``; how many of its bytes crossed for the first time."""
        delta = (end32 - self.furthest % SEQ_SPACE + SEQ_SPACE // 2) % SEQ_SPACE - SEQ_SPACE // 2
        end = self.furthest + delta
        start = end - payload
        self.furthest = max(self.furthest, end)
        if payload <= 0:
            return 0
        if len(self.ranges) == 1 and self.ranges[0][1] == start:  # the common case: the next bytes in order
            self.ranges[0][1] = end
            return payload
        old = sum(max(0, min(end, b) - max(start, a)) for a, b in self.ranges)
        merged = [r for r in self.ranges if r[1] < start or r[0] > end]
        touching = [r for r in self.ranges if not (r[1] < start or r[0] > end)]
        lo = min([start, *(r[0] for r in touching)])
        hi = max([end, *(r[1] for r in touching)])
        merged.append([lo, hi])
        merged.sort()
        if len(merged) > self.MAX_RANGES:  # the oldest holes are past filling: close them
            merged[:2] = [[merged[0][0], merged[1][1]]]
        self.ranges = merged
        return payload - old


class KvTap:
    """One direction's KV bytes per bin from ``t0`` (the host's monotonic clock), as they first crossed."""

    def __init__(self, sock: socket.socket, ports: frozenset[int], t0: float) -> None:
        self.sock, self.ports, self.t0 = sock, ports, t0
        # 8 bytes a bin for the whole run: a list held a pointer and, for every busy bin, an
        # int object (~5 MB a direction over a 45-minute soak, a good part of the delay
        # line's growth there).
        self.bins = array("q")
        self.resent = 0  # payload bytes that crossed again
        self.drops = 0  # frames the socket's buffer could not hold: they crossed uncounted
        # Connections by their addresses and ports, forgotten once idle for ``IDLE_FORGET_S``:
        # a soak opens new ones after every fault, and kept for the run they only grew. One
        # that speaks again is counted afresh from its next segment.
        self._seen: dict[tuple[bytes, int], _Seen] = {}
        self._swept = t0

    IDLE_FORGET_S = 120.0

    def count(self, frame: bytes, when: float) -> None:
        seg = kv_segment(frame, self.ports)
        if seg is None:
            return
        conn, end32, payload = seg
        seen = self._seen.get(conn)
        if seen is None:
            seen = self._seen[conn] = _Seen(end32, when)
        seen.last = when
        if when - self._swept > self.IDLE_FORGET_S / 4:
            self._seen = {c: x for c, x in self._seen.items() if when - x.last <= self.IDLE_FORGET_S}
            self._swept = when
        new = seen.add(end32, payload)
        self.resent += payload - new
        if new:
            i = max(0, int((when - self.t0) / KV_BIN_S))
            if i >= len(self.bins):
                self.bins.frombytes(bytes(8 * (i + 1 - len(self.bins))))
            self.bins[i] += new

    def read(self) -> bool:
        """Count up to ``TAP_BATCH`` frames that crossed; whether more may be waiting."""
        for _ in range(TAP_BATCH):
            try:
                frame, anc, _, _ = self.sock.recvmsg(TAP_SNAP, ANC_SIZE)
            except OSError:  # nothing waiting (BlockingIOError) or the port is gone
                return False
            when = time.monotonic()  # the clock ``t0`` and the components' stamps are on
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                    sec, nsec = struct.unpack_from("qq", data)  # the kernel's, on the wall clock
                    when = min(when, sec + nsec * 1e-9 - (time.time() - when))
            self.count(frame, when)
        return True

    def drain(self) -> None:
        while self.read():
            pass

    def take_drops(self) -> int:
        """Add what the kernel dropped since the last call (PACKET_STATISTICS resets on read)."""
        with contextlib.suppress(OSError):
            self.drops += struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
        return self.drops
