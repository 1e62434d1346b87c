"""Command-line interface: ``testbed net|exec|clean|run|serve|sweep|calibrate|trace|verify|report|soak|profile|
bench``.

Argument parsing and calls only: what a command does lives in its own module
(``testbed.deploy.deployment`` runs policies and traces, ``testbed.load.verify`` checks tokens,
``testbed.net.check`` measures a network, ``testbed.bench`` benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from testbed.bench.links import format_links, run_links_bench
from testbed.bench.net import run_bench
from testbed.bench.sim_speed import run_bench as run_sim_bench
from testbed.cli import net_commands, policy_commands, profile_commands, replay_commands, serve_commands
from testbed.cli.arg_values import retry_policy, scenario_from_args
from testbed.cli.args import build_parser
from testbed.cli.net_commands import require_root, wire_scenario
from testbed.cli.replay_commands import check_executor, policies_for, replay_inputs
from testbed.deploy import forkserver
from testbed.deploy.deployment import network_session
from testbed.engines import kind
from testbed.errors import EXIT_INTERRUPTED, InputError, Terminated, TestbedError
from testbed.faults.timeline import parse_faults
from testbed.load.verify import run_verify
from testbed.outputs import new_run_dir
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate_file
from testbed.traces.stats import format_stats, trace_stats

_MAIN_PID = os.getpid()


def _raise_terminated(signum: int, _frame: object) -> None:
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)  # a library's forked helper must never run our teardown
    raise Terminated(signal.Signals(signum).name)


def cmd_bench_net(args: argparse.Namespace) -> int:
    result = run_bench(scenario_from_args(args), args.impairment, repeats=args.repeats, seconds=args.seconds)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    return 0


def cmd_bench_links(args: argparse.Namespace) -> int:
    with network_session(wire_scenario(args), args.impairment) as net:
        result = run_links_bench(net, lambda c: args.case in c.name, held_s=args.held)
    print(json.dumps(result, indent=2) if args.json else format_links(result))
    return 0 if all(c["passed"] for c in result["cases"]) else 1


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from testbed.bench.transfer_modes import format_transfer, run_transfer_bench  # torch: not for every command

    sizes = tuple(int(x) for x in args.sizes.split(",") if x.strip())
    if not sizes or min(sizes) < args.token_scale:
        raise InputError("--sizes: emulated tokens, each at least the token scale")
    plan, kv_shape = net_commands.emulation_of(args)
    with network_session(plan.wire_scenario(scenario_from_args(args)), args.impairment) as net:
        result = run_transfer_bench(net, plan, kv_shape, sizes)
    print(json.dumps(result, indent=2) if args.json else format_transfer(result))
    return 0


def cmd_bench_sim(args: argparse.Namespace) -> int:
    if min(args.limit, args.token_scale) < 1 or args.emulation_limit < 0 or args.hour < 0:
        raise InputError("bench sim: --limit and --token-scale must be >= 1, --emulation-limit and --hour >= 0")
    if args.emulation_limit:
        require_root()
    return run_sim_bench(args.scenario, args.trace, args.limit, args.emulation_limit, args.token_scale, args.policy,
                         args.hour or None, args.out or new_run_dir("bench-sim"))


def cmd_bench_handoff(args: argparse.Namespace) -> int:
    from testbed.bench.handoff_cost import format_result, run_handoff_bench

    if args.reps < 1 or args.tokens < 1 or args.prompt < 1 or args.load_streams < 0:
        raise InputError("bench handoff: --reps, --tokens and --prompt must be >= 1, --load-streams >= 0")
    sc = wire_scenario(args)
    with network_session(sc, args.impairment) as net:
        result = run_handoff_bench(net, args.reps, args.tokens, args.prompt, args.load_streams)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from testbed.bench.scale import run_bench as run_scale_bench

    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        raise InputError(f"--sizes: expected comma-separated device counts, got {args.sizes!r}") from None
    check_executor(args)
    out = args.out or new_run_dir("bench-scale")
    return run_scale_bench(args.scenario, sizes, out, args.per_device_rps, args.window, args.seed,
                           args.start_dilation, args.executor, args.ray_address, args.ray_retries)


def cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from testbed.experiments.parallel import Replay, run_all
    from testbed.experiments.trace_run import run_trace

    if args.speed <= 0:
        raise InputError(f"--load: must be positive, got {args.speed}")
    sc, policies, wl, opts = replay_inputs(args)
    faults = parse_faults(args.fault, sc.check_fault)
    opts = dataclasses.replace(opts, allow_infidelity=args.allow_infidelity, speed=args.speed,
                               out=Path(args.out) if args.out else None, faults=faults)
    if opts.executor == "ray":  # one replay, as a task on the cluster; its folder comes back here
        opts = dataclasses.replace(opts, out=opts.out or new_run_dir(""))
        print(f"results: {opts.out}", flush=True)
        rc = run_all([Replay(sc, wl, policies, opts)])[0]
        log = opts.out / "replay.log"  # what it printed there: the tables a local run prints
        if log.exists():
            print(log.read_text(), end="")
        return rc
    if args.with_sim and not kind(opts.engine).virtual_time:  # (with --engine sim, the run is the prediction)
        from testbed.experiments.validation import run_with_prediction

        return run_with_prediction(sc, wl, policies, opts)
    return run_trace(sc, wl, policies, opts)


def cmd_trace_stats(args: argparse.Namespace) -> int:
    wl = load_trace(args.file, args.format, args.token_scale, args.max_context)
    st = trace_stats(wl, args.block, args.outputs_cached)
    print(st.model_dump_json(indent=2) if args.json else format_stats(st))
    return 0


def cmd_trace_gen(args: argparse.Namespace) -> int:
    if min(args.first_output_median, args.output_median) < 1:
        raise InputError("--first-output-median and --output-median must be at least 1 token")
    cfg = GenConfig(sessions=args.sessions, seed=args.seed, duration_s=args.duration, above_95=args.above_95,
                    anomalous_share=args.anomalous, context_max=args.context_max,
                    think_mean_s=args.think, calibrate_scale=args.calibrate_scale, turns_max=args.turns_max,
                    first_output_median=args.first_output_median, output_median=args.output_median,
                    arrivals=args.arrivals, rps=args.rps, open_tpot_s=args.open_tpot,
                    outputs_cached=args.outputs_cached)
    print(generate_file(cfg, args.output, args.as_format))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    sc = scenario_from_args(args)
    policies = policies_for(sc, args.policies, args.default_policies)
    return run_verify(sc, args.impairment, policies, args.prompts, args.seed, args.dtype, args.json, args.dilation)


def cmd_report(args: argparse.Namespace) -> int:
    from testbed.analysis.report import rebuild, write_repetitions

    if len(args.run_dirs) > 1:
        if args.out is None:
            raise InputError("--out: needed with several RUN_DIRs (where repetitions.md goes)")
        path = write_repetitions(args.run_dirs, args.out)
        print(path.read_text())
        print(f"written: {path}")
        return 0
    if args.out is not None:
        raise InputError("--out: only with several RUN_DIRs (one run's report is rebuilt in place)")
    run_dir = args.run_dirs[0]
    if not (run_dir / "summary.json").exists():
        from testbed.experiments.sweep_report import rebuild_folder

        rebuilt = rebuild_folder(run_dir)  # a sweep, bathtub or calibration folder
        if rebuilt is not None:
            print(f"written: {', '.join(str(p) for p in rebuilt)}")
            return 0
    paths = rebuild(run_dir)
    print((run_dir / "report.md").read_text())
    print(f"written: {', '.join(str(p) for p in paths)}")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    from testbed.load.soak import SoakOptions, run_soak

    opts = SoakOptions(args.minutes, args.load, args.policy, args.fault_every, args.seed, args.dilation, args.out,
                       retry_policy(args))
    wl = load_trace(args.trace, args.format, args.token_scale, args.max_context)
    return run_soak(scenario_from_args(args), wl, opts)


COMMANDS = {
    "net up": net_commands.cmd_net_up, "net down": net_commands.cmd_net_down, "net check": net_commands.cmd_net_check,
    "clean": net_commands.cmd_clean, "exec": net_commands.cmd_exec,
    "run": cmd_run, "trace stats": cmd_trace_stats, "trace gen": cmd_trace_gen, "verify": cmd_verify,
    "report": cmd_report, "soak": cmd_soak,
    "sweep": replay_commands.cmd_sweep, "calibrate": replay_commands.cmd_calibrate,
    "sensitivity": replay_commands.cmd_sensitivity, "whatif": replay_commands.cmd_whatif,
    "tune": replay_commands.cmd_tune,
    "validate": replay_commands.cmd_validate,
    "bench net": cmd_bench_net, "bench handoff": cmd_bench_handoff, "bench links": cmd_bench_links,
    "bench scale": cmd_bench_scale, "bench sim": cmd_bench_sim, "bench transfer": cmd_bench_transfer,
    "serve": serve_commands.cmd_serve, "bench client": serve_commands.cmd_bench_client,
    "profile fit": profile_commands.cmd_profile_fit, "profile check": profile_commands.cmd_profile_check,
    "profile kv-rate": profile_commands.cmd_profile_kv_rate,
    "policy check": policy_commands.cmd_policy_check,
}  # fmt: skip
# Commands that build namespaces need root (``clean`` decides for itself: nothing to clean needs none).
NEEDS_ROOT = {"exec", "net up", "net down", "net check", "run", "verify", "bench net", "bench handoff", "bench links",
              "bench transfer", "soak", "sweep",
              "calibrate", "sensitivity", "tune", "serve", "bench client", "bench scale", "validate"}
# Commands that start workers: their fork server (torch's imports, seconds) starts at once,
# beside this process's own imports and input checks instead of after them.
STARTS_WORKERS = {"run", "verify", "soak", "sweep", "calibrate", "sensitivity", "tune", "serve", "bench client",
                  "bench scale", "validate"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__ or "").parse_args(argv)
    if getattr(args, "samples", 20) < 20:
        print("error: --samples must be at least 20", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)
    # Python leaves SIGINT ignored when it started ignored (a background job of a
    # non-interactive shell, some CI runners); Ctrl-C or `kill -INT` must still tear down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # The simulator needs neither; nor does a driver whose replays run on a cluster's nodes.
        emulating = (getattr(args, "engine", "emulation") == "emulation"
                     and getattr(args, "executor", "local") == "local")
        if args.command in NEEDS_ROOT and emulating:
            require_root()
        if args.command in STARTS_WORKERS and emulating:
            forkserver.prestart()
        return int(COMMANDS[args.command](args))
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, Terminated):
        print("interrupted; torn down", file=sys.stderr)
        return EXIT_INTERRUPTED
