"""``testbed policy check``: what a user must know before trusting a policy
(``testbed/experiments/policy_check.py``, ``docs/policies.md``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.scope import check_simulable
from testbed.traces import load_trace

DEFAULT_SCENARIO = "topologies/offload.yaml"  # every role in both datacenters: any policy can plan there


def add_policy_parser(sub: Any) -> None:
    policy = sub.add_parser("policy", help="routing policies: check one (docs/policies.md)")
    psub = policy.add_subparsers(dest="policy_cmd", required=True)
    p = psub.add_parser("check", help="a policy through the simulator with faults: every request ends, no dead or "
                                      "absent worker planned, deterministic, as declared; with root, its tokens "
                                      "against the single-process reference")
    p.add_argument("policy", help="NAME[:k=v,...] or FILE.py:Class[:k=v,...] (or module:Class)")
    p.add_argument("--scenario", type=Path, default=Path(DEFAULT_SCENARIO))
    p.add_argument("--trace", type=Path, default=Path("traces/agentic-quick.jsonl"))
    p.add_argument("--token-scale", type=int, default=16, metavar="N")
    p.add_argument("--limit", type=int, default=40, help="requests replayed (default 40)")
    p.add_argument("--no-verify", action="store_true", help="leave out the emulation's token check (root)")
    p.set_defaults(command="policy check")


def cmd_policy_check(args: argparse.Namespace) -> int:
    from testbed.experiments.policy_check import check_policy, format_checks  # the simulator: torch

    spec = parse_policy(args.policy)
    sc = load_scenario(args.scenario)
    check_simulable(sc)
    if args.limit < 1:
        raise InputError(f"--limit: must be at least 1, got {args.limit}")
    wl = load_trace(args.trace, "auto", args.token_scale, getattr(args, "max_context", None)).select(args.limit)
    checks = check_policy(sc, spec, wl, verify_sc=None if args.no_verify else sc)
    print(format_checks(spec, checks))
    return 0 if all(c.passed is not False for c in checks) else 1
