"""What a run directory holds, as typed models: written once by ``testbed run``, read back by
``testbed report`` (and by anyone analysing runs) without re-running anything.

A run directory (``runs/<timestamp>/`` unless ``--out``) holds:

* ``summary.json``: one ``RunSummary``: the trace (``TraceInfo``), the emulation
  (``EmulationSummary``: scales, dilation, emulated and wire rates), the scenario as
  validated, and per policy a ``PolicySummary`` (measured ``Summary``, the policy's own
  counters, the fidelity ``Verdict``) and every worker's ``WorkerStats``;
* ``requests.parquet`` / ``requests.csv``: one row per request and policy
  (``testbed.analysis.metrics.request_rows``; the Parquet file is what reports are rebuilt from);
* ``report.md`` and the PNG plots (``testbed.analysis.report``), always derived from the two above;
* ``logs/<policy>/``: every process's log, kept at teardown.

Every file is written atomically (``testbed.outputs``); ``new_run_dir`` claims a folder no
other run has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from protocol.worker_config import WorkerStats
from testbed.analysis.cost import HardwareCost
from testbed.analysis.fault_impact import FaultImpact
from testbed.analysis.metrics import Summary
from testbed.deploy.emulation import EmulationSummary
from testbed.deploy.fidelity import Verdict
from testbed.engines import kind
from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault
from testbed.outputs import atomic_path
from testbed.policies.base import PolicyReport
from testbed.scenario import Scenario

SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.parquet"


class _Saved(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceInfo(_Saved):
    trace: str
    format: str
    requests: int
    token_scale: int
    block_size: int
    meta: dict[str, Any] = {}  # the trace file's own header fields, as it wrote them


class WanLine(_Saved):
    """KV bytes of one WAN direction as they crossed the line (``testbed.analysis.wan_line``):
    wire bytes per ``bin_s`` emulated seconds from ``start_s`` into the run."""

    start_s: float
    bin_s: float = Field(gt=0)
    wire_bytes: list[int]


class PolicySummary(Summary):
    policy_stats: PolicyReport
    fidelity: Verdict
    impairment: str = ""  # the WAN impairment backend that ran (netem or the delay line) and why
    cost: HardwareCost | None = None  # None: the scenario states no prices
    cost_per_mtok: float | None = None  # the deployment's price for the run per 1M emulated output tokens
    wan_gb: float = 0.0  # emulated GB of KV that crossed the WAN (both directions)
    egress: float | None = None  # their price (costs.wan_egress_per_gb); None: no prices
    cost_per_mtok_with_egress: float | None = None  # hardware and egress per 1M emulated output tokens
    faults: list[AppliedFault] = []  # the fault timeline as it was applied
    fault_impact: list[FaultImpact] = []  # what each applied fault cost (testbed.analysis.fault_impact)
    wan_line: dict[str, WanLine] = {}  # "a->b" -> KV as it crossed; none where nothing counted it (netem)
    # Exceptions no component caught (the simulator: a callback of the model, a worker's task),
    # each named: a bug, which fails the requests it touched and the run (exit 1).
    component_errors: list[str] = []


class RunSummary(_Saved):
    trace: TraceInfo
    speed: float
    limit: int | None
    window: str | None
    emulation: EmulationSummary
    scenario: Scenario  # as validated for the run (emulated units, not the wire's)
    policies: dict[str, PolicySummary]
    workers: dict[str, dict[str, WorkerStats]]
    engine: str = "emulation"  # what produced it: "emulation" (processes, bytes) or "sim" (the simulator)
    node: str = ""  # the host that replayed it (a Ray cluster's node: host/node id)
    wall_s: float = 0.0  # the replay's wall time so far, every policy's (set as each is saved)

    @property
    def units(self) -> str:
        e = self.emulation
        if kind(self.engine).virtual_time:
            return f"emulated seconds (simulated); TPOT per emulated token (s_out = {e.s_out})"
        if e.emulating:
            return f"emulated seconds (D = {e.dilation:g}); TPOT per emulated token (s_out = {e.s_out})"
        return "host seconds (no emulation)"


def write_csv(df: pd.DataFrame, path: Path) -> None:
    """A table as CSV, whole or not at all."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def load_run(run_dir: Path) -> tuple[RunSummary, pd.DataFrame]:
    """A saved run's summary and request rows; a clear error naming the file otherwise."""
    summary_path, rows_path = run_dir / SUMMARY_FILE, run_dir / REQUESTS_FILE
    for p in (summary_path, rows_path):
        if not p.is_file():
            raise InputError(f"{run_dir}: not a run directory ({p.name} missing)")
    try:
        summary = RunSummary.model_validate_json(summary_path.read_text())
    except ValueError as e:
        raise InputError(f"{summary_path}: not a summary this version can read: {e}") from e
    return summary, pd.read_parquet(rows_path)
