"""The ``testbed bench`` subcommands' arguments (``testbed.cli.args`` builds the rest)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

Opts = Callable[[argparse.ArgumentParser], None]


def add_bench_parser(sub: Any, scenario_opts: Opts, wire_opts: Opts, executor_opts: Opts) -> None:
    bench = sub.add_parser("bench", help="benchmarks (slow; not part of make test)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    p = bsub.add_parser("net", help="highest WAN goodput, RTT error, up/down time")
    scenario_opts(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="bench net")
    p = bsub.add_parser("handoff", help="relay -> main decoder handoff: ship KV vs token IDs + recompute")
    scenario_opts(p)
    wire_opts(p)
    p.add_argument("--reps", type=int, default=50, help="repetitions of each method (default 50)")
    p.add_argument("--tokens", type=int, default=100, help="generated tokens handed over (default 100)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens the main decoder holds (default 1024)")
    p.add_argument("--load-streams", type=int, default=2, help="bulk TCP streams loading the WAN (default 2)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="bench handoff")
    p = bsub.add_parser("links", help="the simulator's link model against the emulated line, case by case")
    scenario_opts(p)
    wire_opts(p)
    p.add_argument("--held", type=float, default=0.0, metavar="S",
                   help="also: 10 transfers holding the line saturated for S seconds (e.g. 1800)")
    p.add_argument("--case", default="", metavar="TEXT", help="only the cases whose name contains TEXT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="bench links")
    p = bsub.add_parser("sim", help="the simulator's speed and memory: paper.jsonl on paper.yaml at token scale 1 "
                                    "and at the emulation's, beside the emulation's own rate (make bench-sim)")
    p.add_argument("--scenario", type=Path, default=Path("topologies/paper.yaml"))
    p.add_argument("--trace", type=Path, default=Path("traces/paper.jsonl"))
    p.add_argument("--policy", default="pdd")
    p.add_argument("--limit", type=int, default=1000, help="requests per simulated replay (default 1000)")
    p.add_argument("--token-scale", type=int, default=16, metavar="N",
                   help="the emulation's token scale, for the like-for-like replays (default 16)")
    p.add_argument("--emulation-limit", type=int, default=60, metavar="N",
                   help="requests of the emulation's replay, for its rate (default 60; 0: none)")
    p.add_argument("--hour", type=int, default=0, metavar="N",
                   help="also an emulated hour of the trace's recipe with N requests, at token scale 1")
    p.add_argument("--out", type=Path, help="results folder (default runs/bench-sim-<timestamp>)")
    p.set_defaults(command="bench sim")
    p = bsub.add_parser("client", help="aiperf replays a Mooncake trace against testbed serve; its TTFT/TPOT "
                                       "beside the server's records (make bench-client)")
    p.add_argument("--aiperf", type=Path, default=Path(".venv-client/bin/aiperf"), help="the aiperf executable")
    p.add_argument("--scenario", type=Path, default=Path("topologies/two-dc.yaml"))
    p.add_argument("--trace", type=Path, default=Path("traces/mooncake-sample.jsonl"), help="a Mooncake trace")
    p.add_argument("--policy", default="pdd", help="the served policy (default pdd)")
    p.add_argument("--token-scale", type=int, default=16, metavar="N", help="(default 16; must divide 512)")
    p.add_argument("--dilation", metavar="D|auto", help="default: the scenario's")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--out", type=Path, default=Path("runs/bench-client"))
    p.set_defaults(command="bench client")
    p = bsub.add_parser("scale", help="paper.yaml-shaped PDD clusters of growing size: the dilation that passes, "
                                      "emulated s per wall s, host CPU per request, the delay line's share")
    p.add_argument("--scenario", type=Path, default=Path("topologies/paper.yaml"),
                   help="a PDD scenario of modeled instances to resize (default topologies/paper.yaml)")
    p.add_argument("--sizes", default="4,16,32,75,150", help="devices per deployment, comma-separated")
    p.add_argument("--per-device-rps", type=float, default=0.04, metavar="R",
                   help="offered load per device, requests/s (default 0.04: 3 req/s on 75 devices)")
    p.add_argument("--window", type=float, default=30.0, metavar="S",
                   help="emulated seconds in which sessions start (default 30)")
    p.add_argument("--start-dilation", type=float, default=0.5, metavar="D",
                   help="the first dilation tried; x1.5 while the verdict fails (default 0.5)")
    p.add_argument("--seed", type=int, default=1)
    executor_opts(p)
    p.add_argument("--out", type=Path, help="results folder (default runs/bench-scale-<timestamp>)")
    p.set_defaults(command="bench scale")
    p = bsub.add_parser("transfer", help="KV transfer modes (after the prefill, per chunk, per layer; 1 or 4 "
                                         "connections; idle or loaded line) on the line and the model")
    scenario_opts(p)
    wire_opts(p)
    p.add_argument("--sizes", default="4096,16384,65536", help="emulated prompt tokens, comma-separated")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="bench transfer")
