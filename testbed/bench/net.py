"""`testbed bench net`: the emulated WAN's ceiling (goodput, RTT error) and build/teardown time."""

from __future__ import annotations

import statistics
import time
from typing import Any

from testbed.net import measure, runstate
from testbed.net.build import Network
from testbed.scenario import Scenario


def run_bench(sc: Scenario, impairment: str, repeats: int = 5, seconds: float = 5.0) -> dict[str, Any]:
    runstate.clean_stale()
    ups, downs = [], []
    for _ in range(repeats):
        run = runstate.Run.new()
        t0 = time.monotonic()
        net = Network.up(sc, run, impairment)  # type: ignore[arg-type]
        t1 = time.monotonic()
        net.down()
        ups.append(t1 - t0)
        downs.append(time.monotonic() - t1)

    run = runstate.Run.new()
    with Network.up(sc, run, impairment) as net:  # type: ignore[arg-type]
        a, b = net.plan.wan_between
        src = next(h for h in net.plan.hosts.values() if h.dc == a)
        dst = next(h for h in net.plan.hosts.values() if h.dc == b)
        conf_rtt = sc.wan.forward.delay_ms + sc.wan.reverse.delay_ms
        idle = measure.ping(src.ns, dst.ip, count=50, interval_s=0.02)
        flows = {}
        for streams in (1, 2, 4):
            g = measure.goodput(src.ns, dst.ns, dst.ip, seconds=seconds, streams=streams)
            flows[streams] = g.bits_per_second / 1e9
        backend = net.impairment
        stats = net.delayline_stats()
    best = max(flows, key=lambda k: flows[k])
    result = {
        "scenario": sc.name,
        "network_backend": sc.network.backend,
        "impairment": backend,
        "mtu": sc.network.mtu,
        "rtt_configured_ms": conf_rtt,
        "rtt_median_ms": idle.median_ms,
        "rtt_error_ms": idle.median_ms - conf_rtt,
        "rtt_p99_ms": idle.percentile(99),
        "goodput_gbit_by_streams": flows,
        "goodput_best_gbit": flows[best],
        "up_s": {"median": statistics.median(ups), "max": max(ups)},
        "down_s": {"median": statistics.median(downs), "max": max(downs)},
        "up_plus_down_s_median": statistics.median(u + d for u, d in zip(ups, downs, strict=True)),
        "delayline": stats,
    }
    lines = [
        f"bench net: scenario {sc.name}, network backend {sc.network.backend}, impairment {backend}, "
        f"MTU {sc.network.mtu}",
        f"  RTT configured {conf_rtt:.2f} ms, measured median {idle.median_ms:.2f} ms "
        f"(error {idle.median_ms - conf_rtt:+.2f} ms), p99 {idle.percentile(99):.2f} ms",
    ]
    lines += [f"  TCP goodput, {n} stream(s): {v:.2f} Gbit/s" for n, v in flows.items()]
    lines += [
        f"  best goodput {flows[best]:.2f} Gbit/s ({best} stream(s))",
        f"  up   median {statistics.median(ups):.3f} s, max {max(ups):.3f} s ({repeats} runs)",
        f"  down median {statistics.median(downs):.3f} s, max {max(downs):.3f} s",
        f"  up + down median {result['up_plus_down_s_median']:.3f} s",
    ]
    result["text"] = "\n".join(lines)
    return result
