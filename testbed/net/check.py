"""Fidelity check: configured vs measured RTT, jitter, loss and goodput of a built network.

Verdict rules (also in the README): an RTT fails if its median deviates from the
configured value by more than max(1 ms, 5 %); WAN goodput fails below 90 % of the
configured rate; LAN goodput below 90 % of a configured LAN rate is a warning (the kernel,
not the emulation, is the limit there). Loss and jitter are reported next to their
configured values, and so is each WAN direction's bandwidth-delay product in frames of
the WAN MTU (a warning below 64: TCP over a line that holds a few frames recovers by
timeouts, not like TCP over a long fat pipe).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from testbed.net import measure
from testbed.net.build import Network

MIN_FRAMES_IN_FLIGHT = 64  # below this a TCP flow does not behave like one over a long fat pipe
RTT_ABS_TOL_MS = 1.0
RTT_REL_TOL = 0.05
GOODPUT_MIN_FRACTION = 0.90


@dataclass
class Row:
    path: str
    metric: str
    configured: float | None
    measured: float
    unit: str
    verdict: str  # ok | FAIL | warn | info
    note: str = ""


@dataclass
class Endpoint:
    label: str
    ns: str
    ip: str


def _endpoints(net: Network) -> dict[str, tuple[Endpoint, Endpoint]]:
    """Pick the measured pairs: across the WAN, and inside each datacenter."""
    p = net.plan
    a, b = p.wan_between
    first = {dc: next(h for h in p.hosts.values() if h.dc == dc) for dc in (a, b)}

    def ep(h: Any) -> Endpoint:
        return Endpoint(h.name, h.ns, h.ip)

    pairs = {f"wan {a}->{b}": (ep(first[a]), ep(first[b])), f"wan {b}->{a}": (ep(first[b]), ep(first[a]))}
    for dc in (a, b):
        hosts = [h for h in p.hosts.values() if h.dc == dc]
        if len(hosts) >= 2:
            pairs[f"lan {dc}"] = (ep(hosts[0]), ep(hosts[1]))
        else:
            gw = p.dcs[dc]
            pairs[f"lan {dc}"] = (ep(hosts[0]), Endpoint(f"gw-{dc}", gw.gw_ns, gw.gw_lan_ip))
    return pairs


def warmup_for(rtt_s: float) -> float:
    """Time to leave slow start before goodput is counted: 15 round trips (a window of ~6 MB
    from ten segments doubles in 9), at least half a second."""
    return max(0.5, 15 * rtt_s)


def run_check(net: Network, rtt_samples: int = 40, goodput_s: float = 3.0, wan_only: bool = False) -> list[Row]:
    """Measure every path (``wan_only``: the WAN's alone) against its configuration."""
    sc, p = net.scenario, net.plan
    a, b = p.wan_between
    fwd, rev = sc.wan.forward, sc.wan.reverse
    rows: list[Row] = []
    pairs = {k: v for k, v in _endpoints(net).items() if not wan_only or k.startswith("wan")}
    for path, (src, dst) in pairs.items():
        is_wan = path.startswith("wan")
        if is_wan and path != f"wan {a}->{b}":
            continue  # an RTT covers both directions; measure it once
        res = measure.ping(src.ns, dst.ip, count=rtt_samples, interval_s=0.02)
        label = f"{path.split()[0]} {src.label}<->{dst.label}"
        conf = (fwd.delay_ms + rev.delay_ms) if is_wan else 0.0
        err = abs(res.median_ms - conf)
        tol = max(RTT_ABS_TOL_MS, RTT_REL_TOL * conf)
        ok = res.received > 0 and err <= tol
        rows.append(Row(label, "rtt median", conf, res.median_ms, "ms", "ok" if ok else "FAIL",
                        f"n={res.received}/{res.sent}, p99 {res.percentile(99):.2f} ms, tol ±{tol:.2f}"))
        if is_wan:
            # Uniform jitter in [-j, j] each way: RTT stdev = sqrt((jf^2 + jr^2) / 3).
            jconf = math.sqrt((fwd.jitter_ms**2 + rev.jitter_ms**2) / 3)
            rows.append(Row(label, "rtt stdev", jconf, res.stdev_ms, "ms", "info"))
            lconf = 100 * (1 - (1 - fwd.loss_pct / 100) * (1 - rev.loss_pct / 100))
            rows.append(Row(label, "loss", lconf, res.loss_pct, "%", "info",
                            "round trip; use more samples for a precise figure"))
    for sdc, ddc in ((a, b), (b, a)):
        frames = p.bdp_frames(sdc, ddc)
        if frames is not None:
            rows.append(Row(f"wan {sdc}->{ddc}", "bdp", MIN_FRAMES_IN_FLIGHT, frames, "frames",
                            "ok" if frames >= MIN_FRAMES_IN_FLIGHT else "warn",
                            f"rate x RTT in frames of MTU {p.wan_frame_mtu} (configured = minimum)"))
    for path, (src, dst) in pairs.items():
        is_wan = path.startswith("wan")
        if is_wan:
            sdc, ddc = path.split()[1].split("->")
            rate = sc.wan_direction(sdc, ddc).rate_mbit
        else:
            rate = sc.datacenters[path.split()[1]].lan.rate_mbit
        window, rtt_s = None, 0.0
        if is_wan:
            rtt_s = (sc.wan_direction(sdc, ddc).delay_ms + sc.wan_direction(ddc, sdc).delay_ms) / 1000
        if is_wan and rate:
            window = measure.window_for(rate * 1e6, rtt_s, p.wan_shaping[(sdc, ddc)].queue_bytes)
        res_g = measure.goodput(src.ns, dst.ns, dst.ip, seconds=goodput_s, window_bytes=window,
                                warmup=warmup_for(rtt_s))
        mbit = res_g.bits_per_second / 1e6
        if res_g.error:
            verdict, note = "FAIL", res_g.error
        elif rate is None:
            verdict, note = "info", "unshaped"
        else:
            good = mbit >= GOODPUT_MIN_FRACTION * rate
            verdict = "ok" if good else ("FAIL" if is_wan else "warn")
            note = f"{100 * mbit / rate:.1f}% of configured"
        rows.append(Row(f"{path} {src.label}->{dst.label}", "goodput", rate, mbit, "Mbit/s",
                        verdict, note))
    return rows


def passed(rows: list[Row]) -> bool:
    return all(r.verdict != "FAIL" for r in rows)


def rows_as_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def format_table(rows: list[Row]) -> str:
    head = f"{'path':34} {'metric':11} {'configured':>12} {'measured':>12} {'unit':7} {'verdict':7} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        conf = "unshaped" if r.configured is None else f"{r.configured:.2f}"
        lines.append(
            f"{r.path:34} {r.metric:11} {conf:>12} {r.measured:12.2f} {r.unit:7} {r.verdict:7} {r.note}"
        )
    return "\n".join(lines)


def check_report(net: Network, rows: list[Row], as_json: bool) -> str:
    """What ``testbed net check`` prints: the table and the delay line's statistics, or JSON."""
    import json

    dl = net.delayline_stats_final or net.delayline_stats()
    ok = passed(rows)
    if as_json:
        return json.dumps({"scenario": net.scenario.name, "network_backend": net.nodes.name,
                           "impairment": net.impairment, "passed": ok,
                           "rows": rows_as_dicts(rows), "delayline": dl.model_dump() if dl else None,
                           "timings": net.timings}, indent=2)
    lines = [f"network backend {net.nodes.name}: up in {net.timings.get('up_s', 0):.2f} s, "
             f"down in {net.timings.get('down_s', 0):.2f} s", format_table(rows), *(dl.summary() if dl else [])]
    lines.append("PASS" if ok else "FAIL: measured network deviates from the scenario")
    return "\n".join(lines)
