"""Replays of an experiment side by side: independent simulations in processes of their own.

A sweep, a bathtub or a sensitivity table is many ``testbed run``s that share nothing but
their inputs. Simulations (``--engine sim``) run ``RunOptions.jobs`` at a time, one process
each (a simulation is one core's work); emulations run one after another (one owns the host:
its namespaces, its cores, its fidelity verdict). Each writes its own run folder, so what
they produce is the same whichever order they end in.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.policies.spec import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import Workload


@dataclass(frozen=True)
class Replay:
    sc: Scenario
    wl: Workload
    policies: list[PolicySpec]
    opts: RunOptions


def _one(r: Replay) -> int:
    return run_trace(r.sc, r.wl, r.policies, r.opts)


def run_all(replays: list[Replay]) -> list[int]:
    """Every replay's exit status, in the order given."""
    jobs = min((r.opts.jobs for r in replays), default=1)
    if jobs <= 1 or len(replays) <= 1 or any(r.opts.engine != "sim" for r in replays):
        return [_one(r) for r in replays]
    # Forked: the workers' modules are already imported here, and nothing of this process's
    # state but its inputs is used by a child.
    with ProcessPoolExecutor(min(jobs, len(replays)), mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_one, replays))
