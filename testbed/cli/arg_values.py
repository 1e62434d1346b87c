"""Arguments shared by several commands, turned into the testbed's types and checked: a bad
value is an ``InputError`` naming the option."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from protocol.messages import why_invalid
from testbed.errors import InputError
from testbed.load.retry import RetryPolicy
from testbed.net.topo_import import load_topo_scenario
from testbed.scenario import Scenario, load_scenario


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """``--scenario``, with its network taken from ``--topo`` when given."""
    sc = load_scenario(args.scenario)
    if getattr(args, "topo", None):
        sc = load_topo_scenario(args.topo, sc)
    if getattr(args, "network", None):
        raw = sc.model_dump(mode="json")
        raw["network"]["backend"] = args.network
        try:  # validated again: a backend may bring its own limits (Mininet's interface names)
            sc = Scenario.model_validate(raw).model_copy(update={"source": sc.source})
        except ValidationError as e:
            raise InputError(f"--network {args.network}: {why_invalid(e)}") from None
    return sc


def retry_policy(args: argparse.Namespace) -> RetryPolicy:
    """``--retries``/``--retry-backoff`` as the replayer's retry policy."""
    if args.retries < 0:
        raise InputError(f"--retries: must be 0 or more, got {args.retries}")
    if not 0 <= args.retry_backoff <= 8:
        raise InputError(f"--retry-backoff: seconds in [0, 8], got {args.retry_backoff}")
    return RetryPolicy(retries=args.retries, initial_s=args.retry_backoff)
