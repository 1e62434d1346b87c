"""``testbed serve`` and ``testbed bench client``: arguments in, calls out (the commands
themselves live in ``testbed.serve`` and ``testbed.bench.external_client``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from testbed.cli.arg_values import scenario_from_args
from testbed.deploy.model_files import ensure_model
from testbed.errors import InputError
from testbed.policies import parse_policy


def cmd_serve(args: argparse.Namespace) -> int:
    from testbed.serve.server import ServeOptions, run_serve

    if not 0 <= args.port <= 65535:
        raise InputError(f"--port: must be 0..65535, got {args.port}")
    if args.max_concurrency < 1:
        raise InputError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    if args.default_max_tokens < 1:
        raise InputError(f"--default-max-tokens: must be >= 1, got {args.default_max_tokens}")
    opts = ServeOptions(parse_policy(args.policy), args.port, args.token_scale, args.dilation, args.shape_trace,
                        args.dtype, args.impairment, args.served_model_name, args.out, args.allow_infidelity,
                        args.max_concurrency, args.default_max_tokens)
    return run_serve(scenario_from_args(args), opts)


def cmd_bench_client(args: argparse.Namespace) -> int:
    from testbed.bench.external_client import ClientBenchOptions, run_client_bench

    sc = scenario_from_args(args)  # fails here, naming the file, rather than in the server
    parse_policy(args.policy)
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit: must be >= 1, got {args.limit}")
    opts = ClientBenchOptions(args.aiperf, args.scenario, args.trace, args.policy, args.token_scale, args.dilation,
                              args.limit, args.out)
    return run_client_bench(opts, Path(ensure_model(sc.model_dir())))
