"""KV on the WAN as it crossed the line, and the check that it never crossed faster than the
line allows.

Both engines count KV bytes where they cross (``LineBins``: the delay line's tap on frames as
the direction's rate limiter lets them onto the wire, the link model as its flows move), per
20 ms. A run keeps them per direction in emulated seconds into the run (``WanLine``, at most
``MAX_BINS`` bins: neighbours summed), the timeline plots them against the line's rate, and
``overruns`` says where a bin carried more than the line's rate over the bin plus what its
rate limiter's burst could have let through at once: a figure that contradicts the scenario
is a bug to find, never a picture to show. (Counted as frames entered the rate limiter,
bursts reached 4.8 Gbit/s on a 3.6 Gbit/s line: what its queue let in, not what crossed.)
"""

from __future__ import annotations

import math

from testbed.analysis.results import PolicySummary, RunSummary, WanLine
from testbed.deploy.run_record import LineBins
from testbed.faults.wan_trace import rate_history
from testbed.net.plan import FRAME_OVERHEAD, size_shaping

MAX_BINS = 600
SLACK_FRAMES = 4  # frames at a bin's edges, and the burst's floor of 2 frames
SUM_TOLERANCE = 0.01


def line_of(bins: LineBins, t0: float, dilation: float) -> WanLine:
    """``bins`` (on the client's clock) in emulated seconds from ``t0``, at most ``MAX_BINS``."""
    data = list(bins.bytes)
    while data and data[-1] == 0:
        data.pop()
    k = max(1, math.ceil(len(data) / MAX_BINS))
    merged = [sum(data[i:i + k]) for i in range(0, len(data), k)]
    return WanLine(start_s=(bins.t0 - t0) / dilation, bin_s=bins.bin_s * k / dilation, wire_bytes=merged)


def byte_factor(summary: RunSummary) -> float:
    """Emulated bytes per wire byte of KV (the rows and the line count the real model's)."""
    e = summary.emulation
    return e.s_in * e.b_e / e.b_r if e.emulating else 1.0


def overruns(summary: RunSummary) -> list[str]:
    """Every bin of every policy's line counters above the line's rate over the bin (its
    highest rate in the bin, as faults and link traces set it) plus the rate limiter's burst
    and a few frames (a frame is counted whole in the bin it left in). The counters are taken
    behind the rate limiter, so its buffer is no excuse."""
    sc = summary.scenario
    bf = byte_factor(summary)
    dirs = sc.wan_directions()
    names = list(dirs)
    out = []
    for policy, s in summary.policies.items():
        rates = rate_history(dirs, s.faults)
        for name, line in s.wan_line.items():
            if name not in rates:
                continue  # unshaped: no rate to keep to
            other = dirs[names[1 - names.index(name)]]
            shaping = size_shaping(dirs[name], other, summary.emulation.wan_mtu)
            room = shaping.burst_bytes + SLACK_FRAMES * (summary.emulation.wan_mtu + FRAME_OVERHEAD) * bf
            for i, wire in enumerate(line.wire_bytes):
                start = line.start_s + i * line.bin_s
                limit = _top_rate_mbit(rates[name], start, start + line.bin_s) * 1e6 / 8 * line.bin_s + room
                if wire * bf > limit:
                    out.append(f"{policy} {name}: {wire * bf / 1e6:.3f} MB of KV in the {line.bin_s:.3f} s from "
                               f"{start:.3f} s, above the line's {limit / 1e6:.3f} MB (rate x bin + burst)")
    return out


def _top_rate_mbit(history: list[tuple[float, float]], start: float, end: float) -> float:
    """The highest rate the line had during [start, end) (``history``: (s, Mbit/s) in order)."""
    top = history[0][1]
    for t, r in history:
        if t <= start:
            top = r
        elif t < end:
            top = max(top, r)
    return top


def kv_total(s: PolicySummary) -> int:
    """Wire bytes of KV the line counted, both directions."""
    return sum(sum(line.wire_bytes) for line in s.wan_line.values())


def in_flight_max(summary: RunSummary) -> float:
    """Wire bytes a KV connection can have sent but not yet had acknowledged: what BBR's window
    lets out (twice the path's bandwidth-delay product) plus a full buffer of the line."""
    dirs = summary.scenario.wan_directions()
    names = list(dirs)
    most = 0.0
    for name in names:
        d, reverse = dirs[name], dirs[names[1 - names.index(name)]]
        shaping = size_shaping(d, reverse, summary.emulation.wan_mtu)
        if shaping.rate_bps:
            rtt_s = (d.delay_ms + d.jitter_ms + reverse.delay_ms + reverse.jitter_ms) / 1000
            most = max(most, 2 * shaping.rate_bps / 8 * rtt_s + shaping.queue_bytes)
    return most / byte_factor(summary)


def disagreements(summary: RunSummary) -> list[str]:
    """What a run's line counters contradict: a bin above the line (``overruns``), and, on a
    line that loses nothing (no loss configured, no fault), KV bytes that do not sum to the
    table's WAN KV bytes within ``SUM_TOLERANCE``. The table counts what the receiver
    acknowledged; the line also counts a transfer's replies and, for a transfer cut off (PDD's
    handoff), what it had in flight when it was cut (``wan_kv_in_flight_bytes``: each sender's
    kernel says, at the cut, what it sent and had not had acknowledged; ``in_flight_max`` a
    cut-off in summaries written before it was kept). The estimate alone was not a bound: a clean
    clone's run crossed 4 % more per cut-off than twice the BDP plus the line's buffer."""
    out = overruns(summary)
    lossless = all(d.loss_pct == 0 for d in summary.scenario.wan_directions().values())
    for policy, s in summary.policies.items():
        if not s.wan_line or not lossless or s.faults:
            continue
        line = kv_total(s)
        slack = SUM_TOLERANCE * max(s.wan_kv_bytes, 1)
        in_flight = s.wan_kv_in_flight_bytes
        room = in_flight if in_flight is not None else s.wan_cut_offs * in_flight_max(summary)
        if not -slack <= line - s.wan_kv_bytes <= slack + room:
            cut = f" ({s.wan_cut_offs} transfers cut off, {room} bytes in flight when cut)" if s.wan_cut_offs else ""
            out.append(f"{policy}: the line counted {line} bytes of KV, the table says {s.wan_kv_bytes}{cut}")
    return out


def line_section(summary: RunSummary) -> list[str]:
    """``report.md``'s lines on the WAN's KV as it crossed: each direction's busiest bin
    against the line's rate, and anything the counters contradict."""
    bf, rows = byte_factor(summary), []
    rates = {d: w.rate_mbit for d, w in summary.scenario.wan_directions().items()}
    for policy, s in summary.policies.items():
        for name, line in s.wan_line.items():
            if any(line.wire_bytes):
                peak = max(line.wire_bytes) * bf * 8 / line.bin_s / 1e9
                rate = f"{rates[name] / 1e3:.3g} Gbit/s" if rates.get(name) else "unshaped"
                rows.append(f"- {policy} {name}: {sum(line.wire_bytes) * bf / 1e9:.3f} GB, busiest "
                            f"{line.bin_s:.3g} s at {peak:.3g} Gbit/s (line {rate})")
    if not rows:
        return []
    wrong = disagreements(summary)
    return ["## KV on the WAN, as it crossed the line", "", *rows, "",
            *([f"**The line's counters contradict the run:** {w}" for w in wrong] + [""] if wrong else [])]
