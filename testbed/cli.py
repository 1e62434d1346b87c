"""Command-line interface: ``testbed net|clean|run|trace|verify|bench``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from testbed import netns, runstate
from testbed.errors import InputError, TestbedError
from testbed.scenario import Scenario, load_scenario
from testbed.traces.formats import FORMATS


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so that teardown runs as on Ctrl-C."""


_MAIN_PID = os.getpid()


def _raise_terminated(signum: int, _frame: object) -> None:
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)  # a library's forked helper must never run our teardown
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def network_session(scenario: Scenario, impairment: str) -> Iterator[object]:
    """Build a network for this process's run, always tear it down (error, Ctrl-C, SIGTERM)."""
    from testbed.net.build import Network

    runstate.clean_stale()  # the next start removes what a killed run left behind
    run = runstate.Run.new()
    net = None
    try:
        net = Network.up(scenario, run, impairment)  # type: ignore[arg-type]
        yield net
    finally:
        if net is not None:
            net.down()
        else:
            runstate.destroy(run.run_id, run.namespaces, run.processes)


def _require_root() -> None:

    if os.geteuid() != 0:
        raise TestbedError("this command needs root (network namespaces, netlink, raw sockets)")


# ------------------------------------------------------------------------------- net
def cmd_net_up(args: argparse.Namespace) -> int:
    _require_root()
    sc = load_scenario(args.scenario)
    with network_session(sc, args.impairment) as net:
        print(_describe(net))
        print(f"run {net.run.run_id} is up; Ctrl-C or `testbed net down` tears it down", flush=True)
        while True:
            signal.pause()
    return 0


def _describe(net: object) -> str:
    from testbed.net.build import Network

    assert isinstance(net, Network)
    p = net.plan
    lines = [f"scenario {net.scenario.name}: impairment backend {net.impairment} ({net.impairment_reason})"]
    for dc in p.dcs.values():
        lines.append(f"  datacenter {dc.name}: {dc.subnet} gateway ns {dc.gw_ns}")
        for h in p.hosts.values():
            if h.dc == dc.name:
                role = net.scenario.datacenters[dc.name].hosts[h.name].role
                lines.append(f"    {h.name:14} {h.ip:15} ns {h.ns:24} {role}")
    for (src, dst), s in p.wan_shaping.items():
        rate = f"{s.rate_bps / 1e6:.0f} Mbit/s" if s.rate_bps else "unshaped"
        lines.append(
            f"  wan {src}->{dst}: {rate}, delay {s.delay_ms} ms, jitter {s.jitter_ms} ms, "
            f"loss {s.loss_pct}%, buffer {s.queue_bytes} B, burst {s.burst_bytes} B"
        )
    lines.append(f"  up in {net.timings.get('up_s', 0):.3f} s")
    return "\n".join(lines)


def cmd_net_down(args: argparse.Namespace) -> int:
    _require_root()

    stopped = 0
    for run in runstate.live_runs():
        if args.run and run.run_id != args.run:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.owner_pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while run.owner_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        runstate.destroy(run.run_id, run.namespaces, run.processes)
        print(f"run {run.run_id} down")
        stopped += 1
    removed = runstate.clean_stale()
    if not stopped and not removed:
        print("no run is up")
    return 0


def cmd_net_check(args: argparse.Namespace) -> int:
    _require_root()
    from testbed.net.check import format_table, passed, rows_as_dicts, run_check

    sc = load_scenario(args.scenario)
    with network_session(sc, args.impairment) as net:
        if not args.json:
            print(_describe(net), flush=True)
            print(f"measuring ({args.samples} RTT samples per path, {args.seconds:g} s bulk TCP per path)...",
                  flush=True)
        rows = run_check(net, rtt_samples=args.samples, goodput_s=args.seconds)
        dl = net.delayline_stats()
    ok = passed(rows)
    if args.json:
        print(json.dumps({"scenario": sc.name, "impairment": net.impairment, "passed": ok,
                          "rows": rows_as_dicts(rows), "delayline": net.delayline_stats_final or dl,
                          "timings": net.timings}, indent=2))
    else:
        print(format_table(rows))
        final = net.delayline_stats_final or dl
        if final:
            for name, d in final["directions"].items():
                print(
                    f"delay line {name}: {d['frames_out']} frames out, drops loss={d['drop_loss']} "
                    f"queue-full={d['drop_queue_full']} overflow={d['drop_overflow']} "
                    f"error={d['drop_error']}, late>1ms={d['late_over_1ms']} "
                    f"(max {d['late_max_us'] / 1000:.2f} ms)"
                )
        print("PASS" if ok else "FAIL: measured network deviates from the scenario")
    return 0 if ok else 1


def cmd_clean(args: argparse.Namespace) -> int:
    if not runstate.STATE_ROOT.exists() and not any(
        runstate.PREFIX_RE.match(n) for n in netns.list_namespaces()
    ):
        print("nothing to clean")
        return 0
    _require_root()
    removed = runstate.clean_stale(include_live=args.all)
    for r in removed:
        print(f"removed {r}")
    if not removed:
        print("nothing to clean" + ("" if args.all else " (live runs kept; --all removes them too)"))
    return 0


def cmd_bench_net(args: argparse.Namespace) -> int:
    _require_root()
    from testbed.net.bench import run_bench

    sc = load_scenario(args.scenario)
    result = run_bench(sc, args.impairment, repeats=args.repeats, seconds=args.seconds)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    return 0


def cmd_bench_handoff(args: argparse.Namespace) -> int:
    _require_root()
    from testbed.bench_handoff import format_result, run_handoff_bench

    sc = load_scenario(args.scenario)
    if args.reps < 1 or args.tokens < 1 or args.prompt < 1 or args.load_streams < 0:
        raise InputError("bench handoff: --reps, --tokens and --prompt must be >= 1, --load-streams >= 0")
    with network_session(sc, args.impairment) as net:
        result = run_handoff_bench(net, args.reps, args.tokens, args.prompt, args.load_streams)  # type: ignore[arg-type]
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


# ------------------------------------------------------------------------------- inference
class _Progress:
    """Progress of one replay on stderr: a live line on a terminal, a line every 15 s otherwise."""

    def __init__(self, label: str) -> None:
        self.label, self.tty, self.last = label, sys.stderr.isatty(), 0.0

    def __call__(self, n: int, total: int, failed: int) -> None:
        msg = f"  {self.label}: {n}/{total} requests finished ({failed} failed)"
        if self.tty:
            print("\r" + msg, end="", file=sys.stderr, flush=True)
        elif time.monotonic() - self.last >= 15 or n == total:
            self.last = time.monotonic()
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


@dataclasses.dataclass
class PolicyRun:
    recs: dict  # rid -> ClientRecord
    router: dict  # rid -> router record (plan, events)
    workers: dict  # worker -> statistics
    policy: dict  # the policy's own counters


def _run_policy(sc: Scenario, impairment: str, policy: str, specs: list, dtype: str | None = None,
                faults: dict | None = None, timeout_s: float = 1800.0) -> PolicyRun:
    """Build network + cluster for one policy, replay ``specs``, tear down. Returns records."""
    from testbed.cluster import Cluster

    with network_session(sc, impairment) as net:
        cl = Cluster.start(net, policy, faults=faults, dtype=dtype)  # type: ignore[arg-type]
        progress = _Progress(policy)
        try:
            recs = cl.replay(specs, timeout_s=timeout_s, progress=progress)
        except Exception:
            for name in ["router", *cl.workers]:
                tail = cl.log_tail(name if name == "router" else f"worker-{name}", 1500)
                if tail:
                    print(f"--- {name} log ---\n{tail}", file=sys.stderr)
            raise
        finally:
            progress.close()
        router = cl.router_records()
        return PolicyRun(recs, router, cl.worker_stats(), cl.policy_stats())


def _policy_list(spec: str, option: str) -> list[str]:
    """Split ``a,b:k=v,k2=v2,c`` into policies (options use commas too) and validate each."""
    from testbed.policies import make_policy

    merged: list[str] = []
    for p in filter(None, (x.strip() for x in spec.split(","))):
        if "=" in p and ":" not in p and merged:
            merged[-1] += "," + p
        else:
            merged.append(p)
    if not merged:
        raise InputError(f"{option}: no policy given")
    for p in merged:
        try:
            make_policy(p)
        except (ValueError, TypeError) as e:
            raise InputError(f"{option}: {p}: {e}") from e
    return merged


def _window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        w = (float(lo or 0), float(hi) if hi else float("inf"))
    except ValueError as e:
        raise InputError(f"--window: expected START:END in seconds, got {text!r}") from e
    if not sep or w[0] < 0 or w[1] <= w[0]:
        raise InputError(f"--window: expected START:END in seconds with 0 <= START < END, got {text!r}")
    return w


def cmd_run(args: argparse.Namespace) -> int:
    _require_root()
    from testbed import report
    from testbed.metrics import Slo, format_summary, itls, request_rows, summarize
    from testbed.traces import load_trace

    # Everything the user gave is validated before anything is built or started.
    sc = load_scenario(args.scenario)
    policies = _policy_list(args.policies, "--policies")
    if args.speed <= 0:
        raise InputError(f"--speed: must be positive, got {args.speed}")
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit: must be at least 1, got {args.limit}")
    wl = load_trace(args.trace, args.format, args.token_scale).select(args.limit, _window(args.window))
    if not wl.requests:
        raise InputError(f"{args.trace}: --window/--limit leave no request")
    slo = Slo(args.slo_ttft, args.slo_tpot)
    specs = wl.specs(args.speed)
    out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    info = wl.describe()
    print(f"trace {info['trace']}: {len(specs)} requests ({info['format']}, token scale {wl.token_scale}, "
          f"speed {args.speed:g}); scenario {sc.name}; policies {', '.join(policies)}", flush=True)
    frames, summaries, workers = {}, {}, {}
    for policy in policies:
        t0 = time.monotonic()
        run = _run_policy(sc, args.impairment, policy, specs, timeout_s=args.timeout)
        df = request_rows(run.recs, run.router, specs)
        frames[policy] = df
        summaries[policy] = {**summarize(df, itls(run.recs), slo, run.recs), "policy_stats": run.policy}
        workers[policy] = run.workers
        print(format_summary(policy, summaries[policy]) + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
        for rid, why in list(summaries[policy]["failures"].items())[:5]:
            print(f"    failed {rid}: {why}")
    summary = {"trace": info, "speed": args.speed, "limit": args.limit, "window": args.window,
               "scenario": sc.model_dump(mode="json"), "policies": summaries, "workers": workers}
    paths = report.save(out, frames, summary, workers)
    print()
    print(report.comparison_table(summaries))
    print()
    print(report.comparison_table(summaries, report.PDD_COLUMNS))
    print(f"\nsaved: {', '.join(str(p) for p in paths)}")
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from testbed.traces import load_trace
    from testbed.traces.stats import format_stats, trace_stats

    wl = load_trace(args.file, args.format, args.token_scale)
    st = trace_stats(wl, args.block)
    print(json.dumps(st, indent=2) if args.json else format_stats(st))
    return 0


def cmd_trace_gen(args: argparse.Namespace) -> int:
    from testbed.traces import load_trace
    from testbed.traces.formats import sessions_workload
    from testbed.traces.generate import GenConfig, generate, mooncake_lines, write_jsonl
    from testbed.traces.stats import format_stats, trace_stats

    cfg = GenConfig(sessions=args.sessions, seed=args.seed, duration_s=args.duration, above_95=args.above_95,
                    anomalous_share=args.anomalous, context_max=args.context_max,
                    think_mean_s=args.think, calibrate_scale=args.calibrate_scale)
    if not (0 <= cfg.above_95 <= 1 and 0 <= cfg.anomalous_share < 0.5 and cfg.sessions >= 1):
        raise InputError("trace gen: --above-95 must be in [0, 1], --anomalous in [0, 0.5), --sessions >= 1")
    sessions, header = generate(cfg)
    if args.as_format == "mooncake":
        # Mooncake has no sessions: closed-loop turns are placed at their estimated send time.
        wl = sessions_workload(args.output, enumerate(sessions, 2))
        write_jsonl(args.output, mooncake_lines(wl))
    else:
        write_jsonl(args.output, sessions, header)
    print(f"wrote {args.output} ({args.as_format}, seed {cfg.seed})")
    print(format_stats(trace_stats(load_trace(args.output, args.as_format))))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    _require_root()
    from testbed.verify import compare, verification_prompts
    from workers.model import ModelRunner, ensure_default_model

    sc = load_scenario(args.scenario)
    merged = _policy_list(args.policies, "--policies")
    specs = verification_prompts(args.prompts, args.seed)
    model = str(sc.workers.model) if sc.workers.model else str(ensure_default_model())
    ref_runner = ModelRunner(model, args.dtype)
    if not args.json:
        print(f"reference: generate(do_sample=False), {len(specs)} prompts, dtype {args.dtype}", flush=True)
    refs = {s.rid: ref_runner.reference(s.prompt, s.max_new) for s in specs}
    results = {}
    for p in merged:
        run = _run_policy(sc, args.impairment, p, specs, dtype=args.dtype)
        bad = compare(specs, refs, run.recs)
        pipelines = {}
        for r in run.router.values():
            pipelines[r["pipeline"]] = pipelines.get(r["pipeline"], 0) + 1
        results[p] = {"requests": len(specs), "mismatches": bad, "tokens": sum(len(r) for r in refs.values()),
                      "pipelines": pipelines,
                      "eager_tokens": sum(run.recs[r].by_worker.get(v.get("relay") or "", 0)
                                          for r, v in run.router.items() if r in run.recs),
                      "handoffs": sum(1 for v in run.router.values()
                                      if any(e["kind"] == "extended" and e.get("final") for e in v["events"]))}
        if not args.json:
            verdict = "OK: identical to the reference" if not bad else f"FAIL: {len(bad)} requests differ"
            shape = ", ".join(f"{k} {v}" for k, v in sorted(pipelines.items(), key=str))
            eager = (f", {results[p]['eager_tokens']} eager tokens, {results[p]['handoffs']} requests handed over"
                     if any(r.get("relay") for r in run.router.values()) else "")
            print(f"{p}: {len(specs)} requests, {results[p]['tokens']} tokens ({shape}{eager}): {verdict}")
            for b in bad:
                print(f"  {b['rid']}: {b['problem']}")
    ok = all(not r["mismatches"] for r in results.values())
    if args.json:
        print(json.dumps({"passed": ok, "policies": results}, indent=2))
    return 0 if ok else 1


# ------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="testbed", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def scenario_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--scenario", type=Path, default=Path("topologies/two-dc.yaml"))
        p.add_argument("--impairment", choices=["auto", "netem", "delayline"], default="auto",
                       help="how WAN delay/jitter/loss are made (default: netem if the kernel has it)")

    net = sub.add_parser("net", help="build, check or tear down the emulated network")
    nsub = net.add_subparsers(dest="net_cmd", required=True)
    p = nsub.add_parser("up", help="build the network and hold it until Ctrl-C / `net down`")
    scenario_opts(p)
    p.set_defaults(func=cmd_net_up)
    p = nsub.add_parser("down", help="tear down running networks")
    p.add_argument("--run", help="only this run id")
    p.set_defaults(func=cmd_net_down)
    p = nsub.add_parser("check", help="build, measure configured vs measured, tear down")
    scenario_opts(p)
    p.add_argument("--samples", type=int, default=40, help="RTT samples per path (>= 20)")
    p.add_argument("--seconds", type=float, default=3.0, help="bulk-transfer seconds per path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_net_check)

    p = sub.add_parser("clean", help="remove namespaces, links and processes of dead runs")
    p.add_argument("--all", action="store_true", help="also tear down runs that are still alive")
    p.set_defaults(func=cmd_clean)

    def trace_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", default="auto", help=f"auto | {' | '.join(FORMATS)} (default: auto)")
        p.add_argument("--token-scale", type=int, default=1, metavar="N",
                       help="divide every length (and the prefix block size) by N")

    p = sub.add_parser("run", help="replay a trace under one or more policies; save, plot and compare")
    scenario_opts(p)
    p.add_argument("--trace", type=Path, required=True, help="trace file (formats: traces/README.md)")
    trace_opts(p)
    p.add_argument("--policies", "--policy", dest="policies", default="same-dc,cross-dc",
                   help="comma-separated, each name[:key=value,...] (default same-dc,cross-dc)")
    p.add_argument("--speed", type=float, default=1.0, help="time compression: 2 = arrivals/delays twice as fast")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--window", help="replay only requests sent in START:END seconds of the trace")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="SLO for goodput: TTFT seconds (default 5)")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="SLO for goodput: TPOT seconds (default 0.25)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up on the replay after this many seconds")
    p.add_argument("--out", help="results folder (default runs/<timestamp>)")
    p.set_defaults(func=cmd_run)

    trace = sub.add_parser("trace", help="trace statistics and generation")
    tsub = trace.add_subparsers(dest="trace_cmd", required=True)
    p = tsub.add_parser("stats", help="lengths, arrival rate, prefix-hit distribution of a trace")
    p.add_argument("file", type=Path)
    trace_opts(p)
    p.add_argument("--block", type=int, help="block size for hit rates (default: 512 / token scale)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trace_stats)
    p = tsub.add_parser("gen", help="generate agentic sessions that follow a prefix-hit target")
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=120.0, help="sessions start within this many seconds")
    p.add_argument("--above-95", type=float, default=0.75, help="target share of requests with hit > 95%%")
    p.add_argument("--anomalous", type=float, default=0.035,
                   help="share of long-input, low-hit, short-output requests")
    p.add_argument("--context-max", type=int, default=65536)
    p.add_argument("--think", type=float, default=2.0, help="mean delay between turns, seconds")
    p.add_argument("--calibrate-scale", type=int, default=1,
                   help="calibrate hit shares as replayed with this --token-scale")
    p.add_argument("--as", dest="as_format", choices=["sessions", "mooncake"], default="sessions",
                   help="write agentic sessions (default) or Mooncake records (no sessions: open loop)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(func=cmd_trace_gen)

    p = sub.add_parser("verify", help="compare every policy's greedy tokens with a single-process reference")
    scenario_opts(p)
    p.add_argument("--policies", default="same-dc,cross-dc")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    bench = sub.add_parser("bench", help="benchmarks (slow; not part of make test)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    p = bsub.add_parser("net", help="highest WAN goodput, RTT error, up/down time")
    scenario_opts(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_net)
    p = bsub.add_parser("handoff", help="relay -> main decoder handoff: ship KV vs token IDs + recompute")
    scenario_opts(p)
    p.add_argument("--reps", type=int, default=50, help="repetitions of each method (default 50)")
    p.add_argument("--tokens", type=int, default=100, help="generated tokens handed over (default 100)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens the main decoder holds (default 1024)")
    p.add_argument("--load-streams", type=int, default=2, help="bulk TCP streams loading the WAN (default 2)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_handoff)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "samples", 20) < 20:
        print("error: --samples must be at least 20", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)
    try:
        return int(args.func(args))
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, Terminated):
        print("interrupted; torn down", file=sys.stderr)
        return 130
