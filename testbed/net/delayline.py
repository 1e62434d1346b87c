"""Userspace delay line: the WAN's delay, jitter and loss on kernels without netem.

Runs as its own process inside the WAN namespace (``python -m testbed.net.delayline CFG``).
It reads every frame arriving on each of the two WAN ports with an AF_PACKET socket, holds
it for the direction's delay (+ uniform jitter in [-jitter, +jitter]) and writes it out of the
other port, where the kernel's htb class for that direction enforces the rate and its
byte-fifo is the bottleneck buffer.

Guarantees:

* it never dies on a bad frame or a full queue: ``ENOBUFS`` (the egress qdisc is full) is
  a tail drop, any other send error drops that frame; every drop is counted by cause;
* loss applies to IP frames only (ARP between the gateways is an artifact of emulating
  the line as one segment);
* frames of one direction leave in the order they arrived (jitter never reorders, the way
  a real line behaves; netem reorders, which wrecks TCP);
* faults are applied on request: ``SIGUSR1`` makes it read ``control_path`` (a
  ``DelayLineControl``) and apply each direction's override at once: down (every frame
  dropped, counted as ``drop_fault``), a loss rate, extra delay; an empty control restores
  the configuration (``testbed.deploy.fault_injection``);
* memory is bounded: a direction holds at most ``max_backlog_bytes`` (excess is dropped and
  counted as ``drop_overflow``);
* fidelity is reported, not assumed: how late each frame left versus its schedule is
  measured from when the *kernel* received the frame (``SO_TIMESTAMPNS``), so time the
  frame waited for this loop to be scheduled counts as lateness; a histogram
  (``late_hist`` over ``LATE_EDGES_US``, percentiles ``late_p50_us`` / ``late_p99_us``),
  ``late_max_us`` and ``late_over_1ms`` are part of the statistics it writes to
  ``stats_path`` once a second and on exit;
* KV is counted where it crosses: a tap on each output port (``testbed.net.line_tap``) sees
  frames as the rate limiter lets them onto the wire, and the TCP payload of KV connections
  (``kv_ports``) is binned per 20 ms by the kernel's time stamp (``kv_bins`` in the final
  statistics; ``kv_resent_bytes`` crossed again, ``kv_tap_drops`` frames went uncounted).

Its contract with the orchestrator (``testbed.net.delayline_contract``): a
``DelayLineConfig`` (JSON, the only argument) in, a ``DelayLineReport`` (JSON file) out.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import gc
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from testbed.net.delayline_contract import (
    LATE_EDGES_US,
    DelayLineConfig,
    DelayLineControl,
    DirectionOverride,
    late_percentile,
)
from testbed.net.line_tap import KV_BIN_S, KvTap, open_tap
from testbed.outputs import write_atomic

ETH_P_ALL = 0x0003
ETH_P_ARP = b"\x08\x06"
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # not exported by Python's socket module
SOCK_BUF = 64 * 1024 * 1024
RECV_SIZE = 65536 + 64
BATCH = 256
STATS_PERIOD_S = 1.0
STATS_QUIET_S = 0.005
# How long before a frame is due the loop stops sleeping and polls. Short on purpose: the loop
# runs SCHED_FIFO, and the kernel throttles real-time tasks that use more than
# sched_rt_runtime_us of every sched_rt_period_us (95 %); under steady traffic a 2 ms spin kept
# the loop busy without a pause and the throttle stopped it for 50 ms every second (p99
# lateness 50 ms at 500 Mbit/s). With the PM QoS request below a sleeping CPU wakes in tens of
# microseconds: 0.2 ms measured p99 lateness <= 0.2 ms, 20 % of a core at 500 Mbit/s. 0.05 ms
# holds the same p99 (<= 0.2 ms on a 75-device modeled cluster at D 0.5, ~60,000 frames) with
# 43 % less of the line's CPU, which had become half of such a run's host CPU.
SPIN_S = 0.00005
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # kernel receive time (CLOCK_REALTIME) per frame
# A frame's kernel stamp older than this is taken as this old: only a stepped wall clock puts
# one there (a frame that truly waited a second in the socket fails the verdict anyway).
MAX_STAMP_AGE_S = 1.0
ANC_SIZE = socket.CMSG_SPACE(16)
TAP_WAIT_S = 0.02  # the taps are read when no frame is due soon, or after this long
@dataclass
class DirectionStats:
    frames_in: int = 0
    bytes_in: int = 0
    frames_out: int = 0
    bytes_out: int = 0
    drop_loss: int = 0
    drop_queue_full: int = 0
    drop_overflow: int = 0
    drop_error: int = 0
    drop_fault: int = 0
    backlog_max_bytes: int = 0
    late_max_us: float = 0.0
    late_over_1ms: int = 0
    delay_sum_ms: float = 0.0
    late_hist: list[int] = field(default_factory=lambda: [0] * (len(LATE_EDGES_US) + 1))
    kv_tap_drops: int = 0  # frames that left the line uncounted (the tap's buffer was full)
    kv_resent_bytes: int = 0  # KV payload that crossed again (retransmissions), not in the bins


@dataclass
class Direction:
    """Frames from ``src`` held for ``delay`` then written to ``dst``."""

    name: str
    src: socket.socket
    dst: socket.socket
    delay_s: float
    jitter_s: float
    loss: float
    max_backlog: int
    rng: random.Random
    base_delay_s: float = 0.0
    base_loss: float = 0.0
    down: bool = False
    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    backlog: int = 0
    last_due: float = 0.0
    blocked: bool = False
    stats: DirectionStats = field(default_factory=DirectionStats)
    tap: KvTap | None = None  # KV as it crosses, behind ``dst``'s rate limiter

    def ingest(self, now: float, clock_offset: float) -> None:
        """Read what arrived; ``clock_offset`` = realtime - monotonic, to place the kernel's
        receive timestamps on the monotonic clock."""
        st = self.stats
        for _ in range(BATCH):
            try:
                frame, anc, _, _ = self.src.recvmsg(RECV_SIZE, ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                st.drop_error += 1
                return
            arrived = now
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                    sec, nsec = struct.unpack_from("qq", data)
                    arrived = min(now, max(now - MAX_STAMP_AGE_S, sec + nsec * 1e-9 - clock_offset))
            size = len(frame)
            st.frames_in += 1
            st.bytes_in += size
            if self.down:
                st.drop_fault += 1
                continue
            # ARP only exists because the two gateways share a segment in this emulation;
            # losing it would turn one lost frame into a burst, so loss spares it.
            if self.loss and frame[12:14] != ETH_P_ARP and self.rng.random() < self.loss:
                st.drop_loss += 1
                continue
            if self.backlog + size > self.max_backlog:
                st.drop_overflow += 1
                continue
            delay = self.delay_s
            if self.jitter_s:
                delay = max(0.0, delay + self.rng.uniform(-self.jitter_s, self.jitter_s))
            due = max(arrived + delay, self.last_due)  # FIFO: never overtake the previous frame
            self.last_due = due
            self.queue.append((due, frame))
            self.backlog += size
            st.delay_sum_ms += (due - arrived) * 1e3
            if self.backlog > st.backlog_max_bytes:
                st.backlog_max_bytes = self.backlog

    def release(self, now: float) -> None:
        q, st = self.queue, self.stats
        self.blocked = False
        while q and q[0][0] <= now:
            due, frame = q[0]
            try:
                self.dst.send(frame)
            except (BlockingIOError, InterruptedError):
                self.blocked = True  # socket buffer full: retry when writable
                return
            except OSError as e:
                st.drop_queue_full += e.errno == errno.ENOBUFS
                st.drop_error += e.errno != errno.ENOBUFS
            else:
                st.frames_out += 1
                st.bytes_out += len(frame)
                late_us = (time.monotonic() - due) * 1e6
                st.late_hist[bisect.bisect_left(LATE_EDGES_US, late_us)] += 1
                if late_us > 1000:
                    st.late_over_1ms += 1
                if late_us > st.late_max_us:
                    st.late_max_us = late_us
            q.popleft()
            self.backlog -= len(frame)

    def override(self, o: DirectionOverride) -> None:
        """Apply a fault's effect (or, with a default override, none). Frames already held
        keep their schedule; a shorter delay never makes a frame overtake the previous one."""
        self.down = o.down
        self.loss = self.base_loss if o.loss_pct is None else o.loss_pct / 100
        self.delay_s = self.base_delay_s + o.extra_delay_ms / 1000

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def open_port(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    # Do not read back the frames we ourselves send out of this port.
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            s.setsockopt(socket.SOL_SOCKET, force, SOCK_BUF)  # root: ignores rmem_max
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, plain, SOCK_BUF)
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


def write_stats(path: str, dirs: list[Direction], started: float, final: bool, bins_t0: float = 0.0) -> None:
    # Plain json here (the forwarding loop waits while this runs); the reader validates it
    # as a DelayLineReport. The KV bins (a number per 20 ms) only at the end.
    for d in dirs:
        if d.tap is not None:
            d.stats.kv_tap_drops, d.stats.kv_resent_bytes = d.tap.take_drops(), d.tap.resent
    report = {
        "pid": os.getpid(), "uptime_s": time.monotonic() - started, "final": final,
        "directions": {d.name: {**asdict(d.stats), "backlog_bytes": d.backlog,
                                "late_p50_us": late_percentile(d.stats.late_hist, 50),
                                "late_p99_us": late_percentile(d.stats.late_hist, 99),
                                **({"kv_bins": d.tap.bins.tolist() if d.tap else []} if final else {})} for d in dirs},
        **({"bins_t0": bins_t0, "bin_s": KV_BIN_S} if final else {}),
    }  # fmt: skip
    # json.dumps, not json.dump: dump streams through the pure-Python encoder, whose nested
    # functions refer to each other, a reference cycle per call; with the collector off (see
    # ``run``) every write leaked one (the line's RSS crept 0.24 MB a minute over a soak).
    write_atomic(Path(path), json.dumps(report))


def apply_control(path: str | None, dirs: list[Direction]) -> None:
    """Read the control file and apply it; a missing or bad file is reported and ignored
    (the line keeps forwarding as it was)."""
    if path is None:
        return
    try:
        with open(path) as f:
            control = DelayLineControl.model_validate_json(f.read())
    except (OSError, ValueError) as e:
        print(f"delay line: control file {path}: {e}", file=sys.stderr, flush=True)
        return
    for d in dirs:
        d.override(control.directions.get(d.name, DirectionOverride()))


def run(cfg: DelayLineConfig) -> None:
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The line must not wait behind the workers for a CPU: a frame that waits is late. Real-
    # time scheduling where the host allows it (root, no RT limit), a high nice value otherwise.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(cfg.rt_priority))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(cfg.nice)
    # Nor wait for an idle CPU to wake up (a halted virtual CPU takes ~1 ms): while this
    # file stays open the kernel keeps CPUs in shallow idle states (PM QoS, released on exit).
    qos = None
    with contextlib.suppress(OSError):
        qos = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(qos, struct.pack("i", 0))  # the line must not starve behind the workers
    gc.disable()  # no collector pauses in the forwarding loop; frames hold no cycles
    rng = random.Random(cfg.seed)
    ports = {name: open_port(ifname) for name, ifname in cfg.ports.items()}
    dirs = [
        Direction(
            name=f"{d.src}->{d.dst}",
            src=ports[d.src],
            dst=ports[d.dst],
            delay_s=d.delay_ms / 1e3,
            jitter_s=d.jitter_ms / 1e3,
            loss=d.loss_pct / 100,
            max_backlog=d.max_backlog_bytes,
            rng=random.Random(rng.random()),
            base_delay_s=d.delay_ms / 1e3,
            base_loss=d.loss_pct / 100,
        )
        for d in cfg.directions
    ]
    by_fd = {d.src.fileno(): d for d in dirs}
    # SIGUSR1 (apply the control file) wakes select through this pipe, at once.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    started = time.monotonic()
    bins_t0 = time.monotonic()  # the clock components stamp events with (``protocol.clock.now``)
    for d, spec in zip(dirs, cfg.directions, strict=True):
        if cfg.kv_ports:
            try:
                d.tap = KvTap(open_tap(cfg.ports[spec.dst]), frozenset(cfg.kv_ports), bins_t0)
            except OSError as e:  # forwarding matters more than counting: the plot falls back, labelled
                print(f"delay line {d.name}: no KV tap ({e}); KV is not counted as it crosses",
                      file=sys.stderr, flush=True)
    next_stats = tapped = started
    stats_path = cfg.stats_path
    ready_path = cfg.ready_path
    if ready_path:
        open(ready_path, "w").close()
    while not stop:
        now = time.monotonic()
        # Read at every turn (two vDSO calls): a step of the host's wall clock would otherwise
        # misplace the kernel's stamps until the next read, and a backward step send frames
        # early, without their WAN delay (``ingest`` also bounds a stamp's age).
        clock_offset = time.time() - now
        for d in dirs:
            d.release(now)
        # Statistics are written when no frame is due within STATS_QUIET_S (a frame must not
        # wait for a file write), or when they are a whole period overdue.
        soonest = min((due for d in dirs if (due := d.next_due()) is not None), default=None)
        quiet = soonest is None or soonest - now > STATS_QUIET_S
        if (now >= next_stats and quiet) or now >= next_stats + STATS_PERIOD_S:
            write_stats(stats_path, dirs, started, final=False)
            next_stats = time.monotonic() + STATS_PERIOD_S
        if quiet or now - tapped >= TAP_WAIT_S:
            for d in dirs:
                if d.tap is not None:
                    d.tap.read()
            tapped = now
        timeout = 0.2 if now >= next_stats else min(0.2, next_stats - now)
        for d in dirs:
            due = d.next_due()
            if due is not None and not d.blocked:
                # Wake SPIN_S before a frame is due and poll from there, so the frame does
                # not also wait for a sleeping CPU to wake.
                timeout = min(timeout, max(0.0, due - now - SPIN_S))
        wlist = [d.dst for d in dirs if d.blocked]
        try:
            readable, _, _ = select.select([*by_fd, wake_r], wlist, [], max(0.0, timeout))
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            if fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                apply_control(cfg.control_path, dirs)
            else:
                by_fd[fd].ingest(now, clock_offset)
    for d in dirs:  # what crossed since the last turn
        if d.tap is not None:
            d.tap.drain()
    write_stats(stats_path, dirs, started, final=True, bins_t0=bins_t0)
    for d in dirs:
        if d.tap is not None:
            print(f"delay line {d.name}: {sum(d.tap.bins)} bytes of KV crossed, {d.tap.resent} again, "
                  f"{d.tap.drops} frames uncounted", file=sys.stderr, flush=True)
    if qos is not None:
        os.close(qos)


if __name__ == "__main__":
    run(DelayLineConfig.model_validate_json(sys.argv[1]))
