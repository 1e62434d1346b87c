"""``testbed net up|down|check``, ``testbed exec`` and ``testbed clean``: arguments in,
calls out (networks are built by ``testbed.net.build``, measured by ``testbed.net.check``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from testbed.cli.arg_values import scenario_from_args
from testbed.deploy.deployment import network_session
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.model_files import ensure_model
from testbed.errors import CapabilityError, InputError
from testbed.net import netns, runstate
from testbed.net.check import check_report, passed, run_check
from testbed.net.mininet_nodes import MininetNodes
from testbed.scenario import Scenario
from workers.model_dir import kv_bytes_per_token, kv_dims, read_config


def require_root() -> None:
    if os.geteuid() != 0:
        raise CapabilityError("this command needs root (network namespaces, netlink, raw sockets)")


def wire_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario in wire units (an emulation's rates and delays at this scale and dilation)."""

    sc = scenario_from_args(args)
    if sc.emulation is None:
        return sc
    if args.token_scale < 1 or not 0.1 <= args.dilation <= 1000:
        raise InputError("--token-scale must be >= 1 and --dilation between 0.1 and 1000")
    model = ensure_model(sc.model_dir())
    plan = EmulationPlan.make(sc, args.token_scale, args.dilation, kv_bytes_per_token(model, sc.workers.dtype))
    if not getattr(args, "json", False):
        print(plan.describe(sc))
    return plan.wire_scenario(sc)


def emulation_of(args: argparse.Namespace) -> tuple[EmulationPlan, tuple[int, int, int]]:
    """A scenario's emulation at this scale and dilation, and the real model's KV layout
    (layers, KV heads, head dim): what a bench of the workers' own wire needs."""
    sc = scenario_from_args(args)
    if sc.emulation is None:
        raise InputError(f"{args.scenario}: a bench of the KV wire needs a scenario with an emulation section")
    model = ensure_model(sc.model_dir())
    plan = EmulationPlan.make(sc, args.token_scale, args.dilation, kv_bytes_per_token(model, sc.workers.dtype))
    if not getattr(args, "json", False):
        print(plan.describe(sc))
    return plan, kv_dims(read_config(model))


def cmd_net_up(args: argparse.Namespace) -> int:
    sc = wire_scenario(args)
    if args.cli and sc.network.backend != "mininet":
        raise InputError("net up --cli opens Mininet's CLI: it needs the Mininet backend (--network mininet)")
    with network_session(sc, args.impairment) as net:
        print(net.describe())
        if args.cli:

            assert isinstance(net.nodes, MininetNodes)
            print(f"run {net.run.run_id} is up; Mininet's CLI holds it until `exit` (or end of input)", flush=True)
            net.nodes.cli()
            return 0
        print(f"run {net.run.run_id} is up; Ctrl-C or `testbed net down` tears it down", flush=True)
        while True:
            signal.pause()


def cmd_net_down(args: argparse.Namespace) -> int:
    stopped = runstate.stop_runs(args.run)
    for run_id in stopped:
        print(f"run {run_id} down")
    if not runstate.clean_stale() and not stopped:
        print("no run is up")
    return 0


def cmd_net_check(args: argparse.Namespace) -> int:
    with network_session(wire_scenario(args), args.impairment) as net:
        if not args.json:
            print(net.describe(), flush=True)
            print(f"measuring ({args.samples} RTT samples per path, {args.seconds:g} s bulk TCP per path)...",
                  flush=True)
        rows = run_check(net, rtt_samples=args.samples, goodput_s=args.seconds)
    print(check_report(net, rows, args.json))
    return 0 if passed(rows) else 1


def cmd_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise InputError("exec: no command given (testbed exec HOST -- CMD ...)")
    try:
        ns = runstate.host_namespace(args.host, args.run)
    except LookupError as e:
        raise InputError(f"exec: {e}") from None
    try:
        netns.exec_in(ns, argv)  # returns only if the command could not be started
    except OSError as e:
        print(f"error: exec: {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    if not runstate.check_state_root() and not any(runstate.PREFIX_RE.match(n) for n in netns.list_namespaces()):
        print("nothing to clean")
        return 0
    require_root()
    removed = runstate.clean_stale(include_live=args.all)
    for r in removed:
        print(f"removed {r}")
    if not removed:
        print("nothing to clean" + ("" if args.all else " (live runs kept; --all removes them too)"))
    return 0


