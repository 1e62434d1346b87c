"""What the delay line and the orchestrator exchange: its configuration in, its fault
control (``DelayLineControl``, read on SIGUSR1) and its statistics (``DelayLineReport``,
with the lateness histogram) out. The forwarding loop is ``testbed.net.delayline``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Lateness histogram bucket upper edges, microseconds (the last bucket is everything above).
LATE_EDGES_US = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000, 200000)


def late_percentile(hist: list[int], q: float) -> float:
    """Upper edge (us) of the bucket holding the ``q``-th percentile; inf past the last edge."""
    total = sum(hist)
    if not total:
        return 0.0
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= q / 100 * total:
            return float(LATE_EDGES_US[i]) if i < len(LATE_EDGES_US) else float("inf")
    return float("inf")


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DirectionConfig(_Contract):
    src: str  # datacenter whose WAN port the frames arrive on
    dst: str
    delay_ms: float = Field(ge=0)
    jitter_ms: float = Field(default=0.0, ge=0)
    loss_pct: float = Field(default=0.0, ge=0, lt=100)
    max_backlog_bytes: int = Field(gt=0)  # room for rate x delay in flight plus the egress buffer


class DirectionOverride(_Contract):
    """A fault's effect on one direction, in wire units (see ``testbed.deploy.fault_injection``)."""

    down: bool = False
    loss_pct: float | None = Field(default=None, ge=0, le=100)  # None: the configured loss
    extra_delay_ms: float = Field(default=0.0, ge=0)


class DelayLineControl(_Contract):
    directions: dict[str, DirectionOverride] = {}  # "a->b" -> override; absent: as configured


class DelayLineConfig(_Contract):
    ports: dict[str, str]  # datacenter -> WAN port (interface) in the WAN namespace
    directions: list[DirectionConfig]
    stats_path: str
    control_path: str | None = None  # read on SIGUSR1: a DelayLineControl
    ready_path: str | None = None
    seed: int = 0
    nice: int = -10
    rt_priority: int = Field(default=10, ge=1, le=99)
    kv_ports: list[int] = []  # TCP ports of KV connections: their payload is counted per bin as it crosses


class DirectionReport(_Contract):
    frames_in: int
    bytes_in: int
    frames_out: int
    bytes_out: int
    drop_loss: int
    drop_queue_full: int
    drop_overflow: int
    drop_error: int
    backlog_max_bytes: int
    drop_fault: int = 0
    late_max_us: float
    late_over_1ms: int
    delay_sum_ms: float
    backlog_bytes: int
    late_hist: list[int] = []
    late_p50_us: float = 0.0
    late_p99_us: float = 0.0
    # TCP payload bytes of KV connections per ``bin_s`` from ``bins_t0`` as the rate limiter let
    # them onto the wire (written in the final report only): when KV crossed, not when
    # transfers began or their frames queued.
    kv_bins: list[int] = []
    kv_tap_drops: int = 0  # frames that left uncounted: the bins are short by them (0 in a sound run)
    kv_resent_bytes: int = 0  # KV payload that crossed again (retransmissions), not in the bins

    def since(self, earlier: DirectionReport) -> DirectionReport:
        """What happened after ``earlier`` (a report of the same direction): counters and the
        lateness histogram as differences, percentiles from that histogram. The largest
        lateness is bounded by the highest bucket that grew (the report keeps no maximum
        per window); backlog figures stay as they are now."""
        hist = [n - m for n, m in zip(self.late_hist, earlier.late_hist, strict=False)] or self.late_hist
        top = max((i for i, n in enumerate(hist) if n > 0), default=None)
        edge = float("inf") if top is None or top >= len(LATE_EDGES_US) else float(LATE_EDGES_US[top])
        counters = ("frames_in", "bytes_in", "frames_out", "bytes_out", "drop_loss", "drop_queue_full",
                    "drop_overflow", "drop_error", "drop_fault", "late_over_1ms")
        return self.model_copy(update={
            **{k: getattr(self, k) - getattr(earlier, k) for k in counters},
            "delay_sum_ms": self.delay_sum_ms - earlier.delay_sum_ms,
            "late_hist": hist, "late_max_us": 0.0 if top is None else min(self.late_max_us, edge),
            "late_p50_us": late_percentile(hist, 50), "late_p99_us": late_percentile(hist, 99),
        })


class DelayLineReport(_Contract):
    pid: int
    uptime_s: float
    final: bool
    directions: dict[str, DirectionReport]  # "a->b" -> statistics
    bins_t0: float = 0.0  # when bin 0 of ``kv_bins`` starts, on the host's monotonic clock (``clock.now``)
    bin_s: float = 0.0

    def since(self, earlier: DelayLineReport | None) -> DelayLineReport:
        """This report over the time after ``earlier`` (see ``DirectionReport.since``)."""
        if earlier is None:
            return self
        return self.model_copy(update={"directions": {
            name: d.since(earlier.directions[name]) if name in earlier.directions else d
            for name, d in self.directions.items()}})

    def summary(self) -> list[str]:
        """One line per direction: frames, drops by cause, lateness."""
        return [
            f"delay line {name}: {d.frames_out} frames out, drops loss={d.drop_loss} "
            f"queue-full={d.drop_queue_full} overflow={d.drop_overflow} error={d.drop_error}, "
            f"lateness p50 <= {d.late_p50_us / 1000:g} ms, p99 <= {d.late_p99_us / 1000:g} ms, "
            f"max {d.late_max_us / 1000:.2f} ms, late>1ms={d.late_over_1ms}"
            + (f", {d.kv_tap_drops} frames left uncounted" if d.kv_tap_drops else "")
            for name, d in self.directions.items()
        ]
