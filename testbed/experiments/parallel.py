"""Replays of an experiment side by side: independent simulations in processes of their own.

A sweep, a bathtub or a sensitivity table is many ``testbed run``s that share nothing but
their inputs. Simulations (``--engine sim``) run ``RunOptions.jobs`` at a time, one process
each (a simulation is one core's work); emulations run one after another (one owns the host:
its namespaces, its cores, its fidelity verdict). Each writes its own run folder, so what
they produce is the same whichever order they end in. With ``--executor ray`` every replay is
a task on a cluster instead (``ray_executor.py``), emulations side by side on hosts of their own.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from testbed.analysis.results import SUMMARY_FILE
from testbed.engines import kind
from testbed.experiments.ray_executor import FAILED_FILE, run_on_ray
from testbed.experiments.trace_run import Replay, run_trace

__all__ = ["Replay", "run_all", "saved"]


def _one(r: Replay) -> int:
    return run_trace(r.sc, r.wl, r.policies, r.opts)


def run_all(replays: list[Replay]) -> list[int]:
    """Every replay's exit status, in the order given: on a Ray cluster when the options say so
    (``ray_executor.py``), here otherwise."""
    if replays and replays[0].opts.executor == "ray":
        return run_on_ray(replays)
    jobs = min((r.opts.jobs for r in replays), default=1)
    if jobs <= 1 or len(replays) <= 1 or any(not kind(r.opts.engine).parallel for r in replays):
        return [_one(r) for r in replays]
    # Forked: the workers' modules are already imported here, and nothing of this process's
    # state but its inputs is used by a child.
    with ProcessPoolExecutor(min(jobs, len(replays)), mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_one, replays))


def saved(folders: list[Path]) -> list[Path]:
    """The folders whose replay saved its results; each missing one is named with the reason a
    cluster gave (a replay that failed on every node it was sent to leaves only that)."""
    have = []
    for f in folders:
        if (f / SUMMARY_FILE).exists():
            have.append(f)
            continue
        why = "no results saved"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            why = str(json.loads((f / FAILED_FILE).read_text())["failed"])
        print(f"missing: {f.name}: {why}", file=sys.stderr, flush=True)
    return have
