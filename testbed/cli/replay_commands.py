"""The replaying commands' arguments turned into validated inputs, and the commands that
replay a trace many times (``testbed sweep``, ``testbed calibrate``).

Everything the user gave is validated before anything is built or started: the scenario,
the policies, the trace (file:line: field on error), ``--limit``/``--window`` and the SLO.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from protocol.messages import why_invalid
from testbed.analysis.cost import missing_for
from testbed.analysis.kv_rate import load_cards
from testbed.cli.arg_values import retry_policy, scenario_from_args
from testbed.engines import EMULATION, kind
from testbed.errors import InputError
from testbed.faults.timeline import parse_faults
from testbed.outputs import new_run_dir
from testbed.policies import PolicySpec, make_policy, parse_policy_list
from testbed.scenario import Scenario
from testbed.sim.scope import check_simulable
from testbed.traces import load_trace

if TYPE_CHECKING:  # the replaying modules (pandas, torch) load only for a command that replays
    from testbed.experiments.load_sweep import Draw
    from testbed.experiments.trace_run import RunOptions
    from testbed.traces.workload import Workload


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


def replay_inputs(args: argparse.Namespace) -> tuple[Scenario, list[PolicySpec], Workload, RunOptions]:
    """Scenario, policies, workload and the options shared by run, sweep and calibrate."""
    from testbed.analysis.metrics import Slo
    from testbed.experiments.trace_run import RunOptions

    sc = scenario_from_args(args)
    try:
        sc = sc.with_prefill_cost(args.prefill_cost)
    except ValueError as e:
        raise InputError(f"{sc.source}: {e}") from None
    if args.wan_trace is not None:
        sc = with_wan_trace(sc, args.wan_trace)
    if args.failure_detection is not None:
        sc = sc.model_copy(update={"workers": sc.workers.model_copy(
            update={"failure_detection": args.failure_detection})})
    policies = policies_for(sc, args.policies, args.default_policies)
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit: must be at least 1, got {args.limit}")
    if min(args.slo_ttft, args.slo_tpot) <= 0:
        raise InputError("--slo-ttft and --slo-tpot must be positive")
    wl = load_trace(args.trace, args.format, args.token_scale, args.max_context)
    wl = wl.select(args.limit, _window(args.window))
    if not wl.requests:
        raise InputError(f"{args.trace}: --window/--limit leave no request")
    if kind(args.engine).virtual_time:
        if args.dilation is not None:
            raise InputError("--dilation: the simulator runs in emulated time (no host to dilate for); "
                             "leave it out with --engine sim")
        check_simulable(sc)
    opts = RunOptions(args.impairment, args.dilation, False, 1.0, args.limit, args.window,
                      Slo(args.slo_ttft, args.slo_tpot), args.timeout, retry=retry_policy(args), resume=args.resume,
                      engine=args.engine, jobs=_jobs(args), executor=args.executor, ray_address=args.ray_address,
                      ray_retries=args.ray_retries, trace_decisions=args.trace_decisions)
    check_executor(args)
    if args.resume and args.out is None:
        raise InputError("--resume: needs --out, the folder of the run to resume")
    return sc, policies, wl, opts


def check_executor(args: argparse.Namespace) -> None:
    """``--executor``'s options, refused before anything starts."""
    if args.ray_retries < 0:
        raise InputError(f"--ray-retries: must be at least 0, got {args.ray_retries}")
    if args.executor == "ray":
        from testbed.experiments.ray_executor import ray_address  # pandas, torch

        ray_address(args.ray_address)  # named, or an error before anything starts


def _jobs(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise InputError(f"--jobs: must be at least 1, got {args.jobs}")
    return args.jobs or (os.cpu_count() or 1)


def policies_for(sc: Scenario, text: str | None, default: str = "same-dc,cross-dc") -> list[PolicySpec]:
    """``--policies`` (else the scenario's ``policies``, a plugin's file relative to the
    scenario's, else ``default``), each checked against the scenario: what a policy cannot
    plan without (``Policy.needs``) must be there, or it exits 2 before anything starts."""
    if text is None and sc.policies:
        text = ",".join(sc.resolved_policies())
    policies = parse_policy_list(text or default)
    for spec in policies:
        if missing := missing_for(sc, make_policy(spec)):
            raise InputError(f"{sc.source}: policy {spec.label} needs {' and '.join(missing)} "
                             "(a scenario with one: topologies/offload.yaml)")
    return policies


def with_wan_trace(sc: Scenario, path: Path) -> Scenario:
    """``sc`` with ``path`` replayed on both directions of its line."""
    raw = sc.model_dump(mode="json")
    for direction in ("forward", "reverse"):
        raw["wan"][direction]["trace"] = str(path)
    try:
        return Scenario.model_validate(raw).model_copy(update={"source": sc.source})
    except ValidationError as e:
        raise InputError(f"--wan-trace {path}: {why_invalid(e)}") from None


def _out(args: argparse.Namespace, kind: str) -> Path:
    return args.out or new_run_dir(kind)


def _draws(args: argparse.Namespace, wl: Workload, out: Path) -> list[Draw]:
    from testbed.experiments.repetitions import draws  # pandas

    ds = draws(wl, args.seeds, out, args.limit, _window(args.window))
    if len(ds) > 1:
        print(f"{len(ds)} draws of {args.trace}'s recipe: seeds {', '.join(str(d.seed) for d in ds)} "
              f"(written to {out}/traces/)", flush=True)
    return ds


def cmd_sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from testbed.experiments.load_sweep import SweepOptions, fixed_dilation, load_sweep, parse_range  # pandas
    from testbed.experiments.repetitions import write_seeded_bathtub, write_seeded_sweep

    hit_rates = parse_range(args.hit_rate, "--hit-rate") if args.hit_rate else None
    if hit_rates and hit_rates[-1] > 1:
        raise InputError(f"--hit-rate: rates are fractions in [0, 1], got {args.hit_rate!r}")
    if hit_rates:
        try:
            loads = [float(args.load)]
        except ValueError as e:
            raise InputError(f"--load: with --hit-rate one load, got {args.load!r}") from e
    else:
        loads = parse_range(args.load, "--load")
    if loads[0] <= 0:
        raise InputError(f"--load: loads must be positive, got {args.load!r}")
    if not 0 < args.share <= 1:
        raise InputError(f"--share: expected a fraction in (0, 1], got {args.share}")
    sc, policies, wl, opts = replay_inputs(args)
    out = _out(args, "bathtub" if hit_rates else "sweep")
    ds = _draws(args, wl, out)
    # One dilation for every point of every draw, so all of them compare.
    opts = dataclasses.replace(opts, dilation=fixed_dilation(sc, ds[0].workload, opts).dilation)
    one = len(ds) == 1

    def sub(tag: str) -> SweepOptions:
        return SweepOptions(opts, out if one else out / tag, args.share)

    if hit_rates:
        from testbed.experiments.hit_rate_sweep import compared, hit_sweep

        curves = [(d.seed, hit_sweep(sc, d.workload, policies, hit_rates, loads[0], sub(d.tag))[1]) for d in ds]
        if not one:
            write_seeded_bathtub(curves, out, *compared([p.label for p in policies]))
        print("\n" + (out / "bathtub.md").read_text())
        where = f"{out}/hit-*/" if one else f"{out}/seed-*/hit-*/"
        print(f"saved: {out}/bathtub.csv, bathtub.md, bathtub.png; each rate's run in {where}")
        return _missing(out)
    results = [(d.seed, load_sweep(sc, d.workload, policies, loads, sub(d.tag))) for d in ds]
    if not one:
        write_seeded_sweep(results, out)
    print("\n" + (out / "sweep.md").read_text())
    where = f"{out}/load-*/" if one else f"{out}/seed-*/load-*/"
    print(f"saved: {out}/sweep.md, sweep.png, {'sweep.json, sweep.csv' if one else 'sweep_seeds.csv'}; "
          f"each load's run in {where}")
    return _missing(out)


def _missing(out: Path) -> int:
    """1 when a replay of the experiment never came back (a cluster recorded why in its folder)."""
    from testbed.experiments.ray_executor import FAILED_FILE  # pandas, torch

    lost = sorted(str(p.parent.relative_to(out)) for p in out.rglob(FAILED_FILE))
    if lost:
        print(f"{len(lost)} replays missing from the tables above (each folder's {FAILED_FILE} says why): "
              f"{', '.join(lost)}", file=sys.stderr)
    return 1 if lost else 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from testbed.experiments.load_sweep import SweepOptions, calibrate
    from testbed.experiments.sweep_report import Calibration, save_calibration

    lo_f, hi_f = _range(args.range, "--range")
    if args.tolerance <= 0 or args.steps < 2:
        raise InputError("--tolerance must be positive and --steps at least 2")
    if min(x for x in (args.final_limit, args.final_seeds, 1) if x is not None) < 1:
        raise InputError("--final-limit and --final-seeds must be at least 1")
    sc, policies, wl, opts = replay_inputs(args)
    out = _out(args, "calibrate")
    ds = _draws(args, wl, out)
    final_ds = None
    if args.final_limit is not None or args.final_seeds is not None:
        from testbed.experiments.repetitions import draws

        limit = args.final_limit or args.limit
        whole = load_trace(args.trace, args.format, args.token_scale, args.max_context)
        whole = whole.select(limit, _window(args.window))
        final_ds = draws(whole, args.final_seeds or args.seeds, out, limit, _window(args.window))
    if args.whatif_shares and args.fit != "load,prefill":
        raise InputError("--whatif-shares: with --fit load,prefill (the what-if is the fitted prefill cost's)")
    if args.fit == "load,prefill":
        return _calibrate_regime(args, sc, policies, ds, final_ds or ds, opts, out, (lo_f, hi_f))
    b, gaps, finals = calibrate(sc, ds, policies, lo_f, hi_f, args.tolerance, args.steps, SweepOptions(opts, out),
                                final_ds)
    cal = Calibration(range=args.range, tolerance_s=args.tolerance, seeds=[d.seed for d in ds], steps=b.steps,
                      gaps={f"{load:g}": g for load, g in gaps.items()}, load=b.load, gap_s=b.value,
                      reached=b.reached, finals=[str(f) for f in finals],
                      final_requests=len(final_ds[0].workload.requests) if final_ds else len(ds[0].workload.requests))
    save_calibration(cal, out)
    print("\n" + (out / "calibration.md").read_text())
    print(f"saved: {out}/calibration.md, calibration.json; the bisection's runs in {out}/bisection/")
    return 0 if b.reached else 1


def _range(text: str, what: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        lo_f, hi_f = float(lo), float(hi)
    except ValueError as e:
        raise InputError(f"{what}: expected LOW:HIGH, got {text!r}") from e
    if not sep or not 0 < lo_f < hi_f:
        raise InputError(f"{what}: expected 0 < LOW < HIGH, got {text!r}")
    return lo_f, hi_f


def _shares(text: str | None) -> list[int]:
    """``--whatif-shares 10,20,30``: whole accelerators, each at least 1 (checked before any replay)."""
    if not text:
        return []
    try:
        shares = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--whatif-shares: expected whole numbers of accelerators (10,20,30), got {text!r}") from None
    if min(shares) < 1:
        raise InputError(f"--whatif-shares: a share is at least one accelerator, got {min(shares)}")
    return shares


def _calibrate_regime(args: argparse.Namespace, sc: Scenario, policies: list[PolicySpec], ds: list[Draw],
                      final_ds: list[Draw], opts: RunOptions, out: Path, load_range: tuple[float, float]) -> int:
    from testbed.experiments.regime import fit_regime, whatif_shares

    if args.prefill_cost != 1.0:
        raise InputError("--prefill-cost: --fit load,prefill searches it; leave it out")
    if args.prefill_cost_steps < 2:
        raise InputError("--prefill-cost-steps must be at least 2")
    if not sc.devices:
        raise InputError(f"{sc.source}: --fit load,prefill needs device profiles (a prefill to make costlier)")
    cost_range = _range(args.prefill_cost_range, "--prefill-cost-range")
    shares = _shares(args.whatif_shares)
    fit = fit_regime(sc, ds[0], policies, final_ds, opts, out, load_range, cost_range,
                     (args.tolerance, 2 * args.tolerance), args.steps, args.prefill_cost_steps)
    if shares:
        fit = whatif_shares(sc, fit, final_ds, opts, out, shares)
    print("\n" + (out / "regime.md").read_text())
    print(f"saved: {out}/regime.md, regime.json; the search's runs in {out}/bisection/, the draws at the point in "
          f"{out}/final/")
    return 0 if fit.reached else 1


def cmd_tune(args: argparse.Namespace) -> int:
    from testbed.experiments.tune import TuneOptions, tune

    if args.resume:  # its sampler's state is not saved: a second study would not retrace the first
        raise InputError("--resume: not for tune (run the study again, or resume its trials' runs one by one)")
    sc, policies, wl, opts = replay_inputs(args)
    if len(policies) != 1:
        raise InputError(f"--policy: one policy whose knobs to search, got {args.policies!r}")
    if args.load <= 0 or args.trials < 2 or args.seeds < 1:
        raise InputError("--load must be positive, --trials at least 2 and --seeds at least 1")
    out = _out(args, "tune")
    ds = _draws(args, wl, out)
    concurrent = args.concurrent_trials or (4 if opts.executor == "ray" else 1)
    if concurrent < 1 or (concurrent > 1 and opts.executor != "ray"):
        raise InputError(f"--concurrent-trials: 1 here, or several with --executor ray; got {concurrent}")
    r = tune(sc, wl, ds, TuneOptions(policies[0], args.trials, args.seeds, args.seed, args.load, opts,
                                     concurrent), out)
    print("\n" + (out / "tune.md").read_text())
    print(f"saved: {out}/tune.md, tune.json, tune.png; every trial's run in {out}/trial-NNN/")
    return 0 if r.trials else 1


def cmd_validate(args: argparse.Namespace) -> int:
    import dataclasses

    from testbed.experiments.validation import validate

    if kind(args.engine) is not EMULATION:
        raise InputError("--engine: validate runs both engines itself; leave --engine out")
    if args.speed <= 0:
        raise InputError(f"--load: must be positive, got {args.speed}")
    sc, policies, wl, opts = replay_inputs(args)
    check_simulable(sc)
    faults = parse_faults(args.fault, sc.check_fault)
    opts = dataclasses.replace(opts, speed=args.speed, faults=faults)
    return validate(sc, wl, policies, opts, _out(args, "validate"))


def cmd_sensitivity(args: argparse.Namespace) -> int:
    from testbed.experiments.sensitivity import sensitivity

    sc, policies, wl, opts = replay_inputs(args)
    names = {p.label.split(":")[0] for p in policies}
    if not {"same-dc", "cross-dc", "pdd"} <= names:
        raise InputError(f"--policies: the figures need same-dc, cross-dc and pdd, got {args.policies!r}")
    out = _out(args, "sensitivity")
    sensitivity(sc, wl, args.load, opts, out, policies=policies)
    print("\n" + (out / "sensitivity.md").read_text())
    print(f"written: {out}/sensitivity.json, sensitivity.md, tornado.png; each row's run under {out}/<row>/")
    return 0


def cmd_whatif(args: argparse.Namespace) -> int:
    from testbed.experiments.model_whatif import model_whatif

    args.engine = "sim"  # the simulator's question; a row is confirmed with testbed validate
    sc, policies, wl, opts = replay_inputs(args)
    if args.load <= 0:
        raise InputError(f"--load: must be positive, got {args.load}")
    opts = dataclasses.replace(opts, speed=args.load)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise InputError(f"--rates: comma-separated Gbit/s, got {args.rates!r}") from None
    cards = load_cards(args.cards or sorted(Path("topologies/models").glob("*.yaml")))
    out = _out(args, "whatif")
    model_whatif(sc, wl, cards, rates, opts, out, policies, whole=args.whole_cards)
    print("\n" + (out / "whatif.md").read_text())
    print(f"written: {out}/whatif.json, whatif.md, gap_vs_kv.png; each row's run under {out}/<card>-<rate>g/")
    return 0
