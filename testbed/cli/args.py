"""The ``testbed`` command line's arguments (``testbed.cli.main`` maps each command to its call;
``arg_values`` turns the shared ones into the testbed's types).

Each subcommand sets ``command`` to its name (``"net up"``, ``"run"``, ...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from testbed.cli.bench_args import add_bench_parser
from testbed.cli.policy_commands import add_policy_parser
from testbed.cli.profile_commands import add_profile_parser
from testbed.load.retry import SOAK_RETRY
from testbed.traces.formats import FORMATS


def build_parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="testbed", description=description)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def scenario_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--scenario", type=Path, default=Path("topologies/two-dc.yaml"))
        p.add_argument("--topo", metavar="FILE.py:CLASS",
                       help="a Mininet Topo subclass for the network (hosts with roles, one switch per datacenter, "
                            "one switch-to-switch WAN link); the rest comes from --scenario")
        p.add_argument("--impairment", choices=["auto", "netem", "delayline"], default="auto",
                       help="how WAN delay/jitter/loss are made (default: netem if the kernel has it)")
        p.add_argument("--network", choices=["pyroute2", "mininet"],
                       help="who builds namespaces, links and bridges (default: the scenario's network.backend)")

    net = sub.add_parser("net", help="build, check or tear down the emulated network")
    nsub = net.add_subparsers(dest="net_cmd", required=True)
    def wire_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--token-scale", type=int, default=1, metavar="N",
                       help="with an emulation: replayed tokens stand for N emulated ones (wire rates follow)")
        p.add_argument("--dilation", type=float, default=1.0, metavar="D", help="with an emulation: time dilation")

    p = nsub.add_parser("up", help="build the network and hold it until Ctrl-C / `net down`")
    scenario_opts(p)
    wire_opts(p)
    p.add_argument("--cli", action="store_true",
                   help="Mininet backend: hold it in Mininet's CLI (`prefill ping decode-b`) until `exit`")
    p.set_defaults(command="net up")
    p = nsub.add_parser("down", help="tear down running networks")
    p.add_argument("--run", help="only this run id")
    p.set_defaults(command="net down")
    p = nsub.add_parser("check", help="build, measure configured vs measured, tear down")
    scenario_opts(p)
    wire_opts(p)
    p.add_argument("--samples", type=int, default=40, help="RTT samples per path (>= 20)")
    p.add_argument("--seconds", type=float, default=3.0, help="bulk-transfer seconds per path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="net check")

    p = sub.add_parser("exec", help="run a command inside a host of a running emulation; its exit status is ours",
                       usage="testbed exec [--run ID] HOST -- CMD [ARG ...]")
    p.add_argument("--run", help="the run id, when several live runs have HOST")
    p.add_argument("host", metavar="HOST", help="a scenario host, gw-<dc> (a gateway) or wan")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="CMD", help="the command and its arguments")
    p.set_defaults(command="exec")

    p = sub.add_parser("clean", help="remove namespaces, links and processes of dead runs")
    p.add_argument("--all", action="store_true", help="also tear down runs that are still alive")
    p.set_defaults(command="clean")

    def retry_opts(p: argparse.ArgumentParser, retries: int = 2, backoff: float = 0.5, why: str = "the OpenAI SDK's"
                   ) -> None:
        p.add_argument("--retries", type=int, default=retries, metavar="N",
                       help=f"send a failed request again up to N times, as an agent's client would (default "
                            f"{retries}, {why}); its session goes on once a retry succeeds")
        p.add_argument("--retry-backoff", type=float, default=backoff, metavar="S",
                       help="emulated seconds before the first retry, doubling for each next one up to 8 s, "
                            f"less up to a quarter at random (default {backoff:g})")

    def trace_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", default="auto", help=f"auto | {' | '.join(FORMATS)} (default: auto)")
        p.add_argument("--token-scale", type=int, default=1, metavar="N",
                       help="divide every length (and the prefix block size) by N")
        p.add_argument("--max-context", type=int, metavar="N", help="a prompt longer than N (emulated) tokens "
                       "keeps its last N, as a serving engine truncates it (counted: trace.meta.max_context)")

    def executor_opts(p: argparse.ArgumentParser) -> None:
        """Where an experiment's replays run: here, or each a task on a Ray cluster."""
        p.add_argument("--executor", choices=["local", "ray"], default="local",
                       help="local: replays on this host (default); ray: each replay a task on a Ray cluster, "
                            "emulations one per node (pip install -e '.[cluster]'; docs/scale-out.md)")
        p.add_argument("--ray-address", metavar="HOST:PORT",
                       help="with --executor ray: the cluster's head (default: RAY_ADDRESS)")
        p.add_argument("--ray-retries", type=int, default=2, metavar="N",
                       help="with --executor ray: a replay whose worker or node died is sent again up to N times, "
                            "then recorded as failed (default 2)")

    def replay_opts(p: argparse.ArgumentParser, policies: str) -> None:
        """What a replay of a trace needs (run, sweep, calibrate)."""
        scenario_opts(p)
        p.add_argument("--trace", type=Path, required=True, help="trace file (formats: traces/README.md)")
        trace_opts(p)
        p.add_argument("--policies", "--policy", dest="policies", help="comma-separated, each name[:key=value,...] "
                       f"or FILE.py:Class[:key=value,...] (default: the scenario's policies, else {policies})")
        p.set_defaults(default_policies=policies)
        p.add_argument("--limit", type=int, help="replay only the first N requests")
        p.add_argument("--trace-decisions", action="store_true",
                       help="save each policy's plans with the workers they weighed (decisions-<policy>.jsonl)")
        p.add_argument("--window", help="replay only requests sent in START:END seconds of the trace")
        p.add_argument("--slo-ttft", type=float, default=5.0, help="SLO for goodput: TTFT seconds (default 5)")
        p.add_argument("--slo-tpot", type=float, default=0.25, help="SLO for goodput: TPOT seconds (default 0.25)")
        p.add_argument("--timeout", type=float, default=1800.0,
                       help="give up on a replay after this many (emulated) seconds")
        p.add_argument("--dilation", metavar="D|auto",
                       help="real seconds per emulated second (default: the scenario's emulation.time_dilation)")
        p.add_argument("--wan-trace", type=Path, metavar="FILE",
                       help="replay this link trace on both directions of the line, in emulated time (CSV "
                            "t_s,rate_mbit|rate_pct[,delay_ms[,loss_pct]] or Mahimahi; traces/wan/)")
        p.add_argument("--failure-detection", choices=["probe", "none"],
                       help="the router's failure detector (default: the scenario's workers.failure_detection): "
                            "probe confirms a last will and ends a dead worker's requests at once; none ignores "
                            "wills, as a router without health checks (docs/faults.md, the PD outage)")
        p.add_argument("--engine", choices=["emulation", "sim"], default="emulation",
                       help="emulation: real processes, bytes and TCP in namespaces (default); sim: the same router, "
                            "policies, workers and device model in virtual time, with the network modeled: seconds "
                            "instead of minutes, and production lengths (docs/simulation.md)")
        p.add_argument("--prefill-cost", type=float, default=1.0, metavar="X", help="prefill FLOPs take X times longer")
        p.add_argument("--jobs", type=int, metavar="N",
                       help="with --engine sim: an experiment's replays N at a time, one process each (default: the "
                            "cores); an emulation runs one replay at a time")
        p.add_argument("--resume", action="store_true",
                       help="with --out naming an earlier run's folder: keep every replay it saved that matches this "
                            "one (trace, load, scenario, emulation) and run only what is missing")
        executor_opts(p)
        retry_opts(p)

    p = sub.add_parser("run", help="replay a trace under one or more policies; save, plot and compare")
    replay_opts(p, "same-dc,cross-dc")
    p.add_argument("--load", "--speed", dest="speed", type=float, default=1.0, metavar="X",
                   help="offered load, x the trace's arrival rate: every arrival offset and think time divided by "
                        "X (default 1; an open-loop trace's load is then exactly X times its own)")
    p.add_argument("--allow-infidelity", action="store_true",
                   help="exit 0 even when the fidelity verdict fails (it is still printed and saved)")
    p.add_argument("--with-sim", action="store_true",
                   help="first the simulator's prediction of the same replay (seconds), then the emulation, then "
                        "the two side by side with testbed validate's tolerances")
    p.add_argument("--out", help="results folder (default runs/<timestamp>)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@START[+DUR][:k=v,...]",
                   help="inject a fault at an emulated time of the replay (repeatable): wan-down, loss (pct), "
                        "delay (ms), rate (mbit), partition (dc), kill (host), broker-restart; e.g. wan-down@10+5, "
                        "kill@20:host=relay; see README, Faults")
    p.set_defaults(command="run")

    p = sub.add_parser("sweep", help="replay a trace at several offered loads: SLO attainment, SLA throughput "
                                     "and BCR per policy (each load a saved run)")
    replay_opts(p, "same-dc,pdd")
    p.add_argument("--load", required=True, metavar="A:B:STEP|X",
                   help="loads, x the trace's own rate (e.g. 0.5:2:0.5); with --hit-rate one load X")
    p.add_argument("--hit-rate", metavar="A:B:STEP", help="sweep the prefix-hit rate instead (e.g. 0:1:0.05): "
                   "every prompt rewritten to share that fraction with a common stream; the bathtub")
    p.add_argument("--share", type=float, default=0.9, help="share of requests that must meet the SLO (default 0.9)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="repeat over N draws of a generated trace's recipe (seeds s..s+N-1, s the file's): "
                        "mean and 95%% interval (default 1)")
    p.add_argument("--out", type=Path, help="results folder (default runs/sweep-<timestamp>)")
    p.set_defaults(command="sweep")

    p = sub.add_parser("calibrate", help="bisect the offered load until cross-dc minus same-dc P50 TTFT is +2.5 s "
                                         "(the report's), then run the policies there beside the report's figures")
    replay_opts(p, "same-dc,cross-dc,pdd")
    p.add_argument("--range", default="0.25:4", metavar="LOW:HIGH", help="loads to search, x the trace's rate")
    p.add_argument("--tolerance", type=float, default=0.25, help="seconds either side of +2.5 s (default 0.25)")
    p.add_argument("--steps", type=int, default=7, help="at most this many loads tried (default 7)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="repeat over N draws of a generated trace's recipe (seeds s..s+N-1, s the file's): "
                        "mean and 95%% interval (default 1)")
    p.add_argument("--final-limit", type=int, metavar="N",
                   help="at the load found, every policy replays N requests (default: --limit; the bisection "
                        "needs fewer than the figures)")
    p.add_argument("--final-seeds", type=int, metavar="N",
                   help="at the load found, over N draws of the recipe (default: --seeds)")
    p.add_argument("--fit", choices=["load", "load,prefill"], default="load", metavar="load|load,prefill",
                   help="load: for the +2.5 s gap (default); load,prefill: for same-dc P50 4.2 s and cross-dc 6.7 s")
    p.add_argument("--prefill-cost-range", default="1:32", metavar="LOW:HIGH", help="with load,prefill (default 1:32)")
    p.add_argument("--prefill-cost-steps", type=int, default=7, metavar="N", help="with load,prefill (default 7)")
    p.add_argument("--whatif-shares", metavar="S,..", help="with load,prefill: PDD vs same-dc at these prefill shares")
    p.add_argument("--out", type=Path, help="results folder (default runs/calibrate-<timestamp>)")
    p.set_defaults(command="calibrate")

    p = sub.add_parser("sensitivity", help="the headline figures across the report's unknowns (line, RTT, mean "
                                           "hit, load), one at a time, with a tornado plot")
    replay_opts(p, "same-dc,cross-dc,pdd")
    p.add_argument("--load", type=float, required=True, metavar="X",
                   help="the baseline load, x the trace's rate (the calibrated one: calibration.json's load)")
    p.add_argument("--out", type=Path, help="results folder (default runs/sensitivity-<timestamp>)")
    p.set_defaults(command="sensitivity")
    p = sub.add_parser("whatif", help="the gap decode across the line adds, per model card and line rate "
                                      "(the simulator; docs/models.md)")
    replay_opts(p, "same-dc,cross-dc,pdd")
    p.add_argument("--cards", type=Path, nargs="+", metavar="CARD.yaml", help="default: topologies/models/*.yaml")
    p.add_argument("--rates", default="10,100", metavar="GBIT,..", help="line rates (default 10,100)")
    p.add_argument("--whole-cards", action="store_true",
                   help="each card as the emulated model, compute too (default: its KV and state only)")
    p.add_argument("--load", type=float, default=1.0, metavar="X", help="x the trace's rate (default 1)")
    p.add_argument("--out", type=Path, help="results folder (default runs/whatif-<timestamp>)")
    p.set_defaults(command="whatif")

    p = sub.add_parser("tune", help="search a policy's knobs for the most SLA goodput per price (Optuna's TPE): "
                                    "every trial a saved run, the Pareto front, the best and the defaults over draws")
    replay_opts(p, "pdd")
    p.add_argument("--trials", type=int, default=12, help="runs of the search, the defaults first (default 12)")
    p.add_argument("--seeds", type=int, default=3, metavar="N",
                   help="the defaults and the best trial again over N draws of the trace's recipe (default 3)")
    p.add_argument("--seed", type=int, default=1, help="the sampler's seed (default 1)")
    p.add_argument("--load", type=float, default=1.0, metavar="X", help="offered load, x the trace's rate")
    p.add_argument("--concurrent-trials", type=int, metavar="N",
                   help="with --executor ray: N trials on the cluster at once, each asking the sampler as it "
                        "starts (default 4; locally one at a time)")
    p.add_argument("--out", type=Path, help="results folder (default runs/tune-<timestamp>)")
    p.set_defaults(command="tune")

    p = sub.add_parser("validate", help="replay the same trace in the emulation and in the simulator; every "
                                        "figure's difference against its tolerance (docs/simulation.md)")
    replay_opts(p, "same-dc,cross-dc,pdd")
    p.add_argument("--load", "--speed", dest="speed", type=float, default=1.0, metavar="X",
                   help="offered load, x the trace's arrival rate (default 1)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@START[+DUR][:k=v,...]",
                   help="the same fault timeline in both engines (as testbed run --fault)")
    p.add_argument("--out", type=Path, help="results folder (default runs/validate-<timestamp>): emulation/, sim/, "
                                            "validation.md")
    p.set_defaults(command="validate")

    trace = sub.add_parser("trace", help="trace statistics and generation")
    tsub = trace.add_subparsers(dest="trace_cmd", required=True)
    p = tsub.add_parser("stats", help="lengths, arrival rate, prefix-hit distribution of a trace")
    p.add_argument("file", type=Path)
    trace_opts(p)
    p.add_argument("--block", type=int, help="block size for hit rates (default: 512 / token scale)")
    p.add_argument("--outputs-cached", action=argparse.BooleanOptionalAction, default=None,
                   help="count each answer as cached after its request (a scenario with workers.cache_outputs; "
                        "default: as the generator's header says)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="trace stats")
    p = tsub.add_parser("gen", help="generate agentic sessions that follow a prefix-hit target")
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=120.0, help="sessions start within this many seconds")
    p.add_argument("--rps", type=float, metavar="R",
                   help="mean requests per second over --duration instead of a count of --sessions")
    p.add_argument("--arrivals", choices=["closed", "open"], default="closed",
                   help="closed: a turn follows the previous answer after --think (default); open: every turn "
                        "at a fixed time, so the offered load does not depend on the system's speed")
    p.add_argument("--open-tpot", type=float, default=0.03, metavar="S",
                   help="open arrivals: nominal seconds per output token of a turn before the next (default 0.03)")
    p.add_argument("--above-95", type=float, default=0.75, help="target share of requests with hit > 95%%")
    p.add_argument("--anomalous", type=float, default=0.035,
                   help="share of long-input, low-hit, short-output requests")
    p.add_argument("--context-max", type=int, default=65536)
    p.add_argument("--think", type=float, default=2.0, help="mean delay between turns, seconds")
    p.add_argument("--turns-max", type=int, default=14, help="turns per session: uniform in 3..N")
    p.add_argument("--first-output-median", type=int, default=800, metavar="N",
                   help="median output tokens of a session's first turn (lognormal; default 800)")
    p.add_argument("--output-median", type=int, default=500, metavar="N",
                   help="median output tokens of follow-up turns (lognormal; default 500)")
    p.add_argument("--calibrate-scale", type=int, default=1,
                   help="calibrate hit shares as replayed with this --token-scale")
    p.add_argument("--outputs-cached", action="store_true",
                   help="size hits for a system that caches each answer after its request (workers.cache_outputs): "
                        "the report's 70-80 %% above 95 %% with ~1K-token answers")
    p.add_argument("--as", dest="as_format", choices=["sessions", "mooncake"], default="sessions",
                   help="write agentic sessions (default) or Mooncake records (no sessions: open loop)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(command="trace gen")

    p = sub.add_parser("verify", help="compare every policy's greedy tokens with a single-process reference")
    scenario_opts(p)
    p.add_argument("--policies", help="comma-separated, each name[:key=value,...] or FILE.py:Class[:key=value,...] "
                                      "(default: the scenario's policies, else same-dc,cross-dc)")
    p.set_defaults(default_policies="same-dc,cross-dc")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--dilation", type=float, default=1.0, metavar="D",
                   help="time dilation for the paced workers (default 1: verify checks tokens, not time)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command="verify")

    p = sub.add_parser("report", help="rebuild report.md and the plots of a saved run, or tabulate repetitions "
                                      "(mean and 95%% interval over several runs); nothing is re-run")
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="folders written by `testbed run`")
    p.add_argument("--out", type=Path, help="with several RUN_DIRs: where repetitions.md goes (required)")
    p.set_defaults(command="report")

    p = sub.add_parser("soak", help="a long replay under a random fault every minute: nothing may hang or be "
                                    "lost; memory of every process over time")
    scenario_opts(p)
    p.add_argument("--trace", type=Path, default=Path("traces/agentic-quick.jsonl"))
    trace_opts(p)
    p.add_argument("--minutes", type=float, default=30.0, help="emulated minutes of replay (default 30; wall: x D)")
    p.add_argument("--load", type=float, default=0.4,
                   help="times the trace's session-start rate, copies back to back (default 0.4: about 1.6x the "
                        "request rate one replay of the default trace averages)")
    p.add_argument("--policy", default="pdd", help="one policy, name[:key=value,...] (default pdd)")
    p.add_argument("--fault-every", type=float, default=60.0, metavar="S",
                   help="a fault of a random kind every S emulated seconds (default 60)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dilation", metavar="D|auto", help="default: the scenario's")
    retry_opts(p, SOAK_RETRY.retries, SOAK_RETRY.initial_s, "waits of 1, 2, 4 and 8 s: a killed worker's restart "
               "fits in them")
    p.add_argument("--out", type=Path, help="results folder (default runs/soak-<timestamp>)")
    p.set_defaults(command="soak")

    p = sub.add_parser("serve", help="the emulation behind an OpenAI-compatible HTTP API on 127.0.0.1 until "
                                     "Ctrl-C; the served requests are saved as a run")
    scenario_opts(p)
    p.add_argument("--policy", default="pdd", help="one policy, name[:key=value,...] (default pdd)")
    p.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1 (default 8000; 0: any free one)")
    p.add_argument("--token-scale", type=int, default=16, metavar="N",
                   help="each token a client sends or receives stands for N emulated tokens (default 16, as "
                        "make run-trace)")
    p.add_argument("--dilation", metavar="D|auto", help="real seconds per emulated second (default: the scenario's)")
    p.add_argument("--shape-trace", type=Path, default=Path("traces/agentic-quick.jsonl"),
                   help="--dilation auto calibrates on work shaped like this trace (default agentic-quick)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"],
                   help="the real model's dtype (default: the scenario's; float64 as verify)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model directory's name)")
    p.add_argument("--max-concurrency", type=int, default=256, metavar="N",
                   help="requests in progress at once; more are answered 429 (default 256)")
    p.add_argument("--default-max-tokens", type=int, default=1024, metavar="N",
                   help="max_tokens of a chat request that sets none, at most what the context leaves (default 1024)")
    p.add_argument("--allow-infidelity", action="store_true",
                   help="exit 0 even when the fidelity verdict fails (it is still printed and saved)")
    p.add_argument("--out", type=Path, help="results folder (default runs/serve-<timestamp>)")
    p.set_defaults(command="serve")

    add_profile_parser(sub)

    add_bench_parser(sub, scenario_opts, wire_opts, executor_opts)
    add_policy_parser(sub)
    return ap
