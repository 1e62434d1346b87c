"""What each engine builds for one replay: its emulation plan and its deployment (both behind
the same interface: a context manager whose ``run(load)`` returns a ``PolicyRun``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from testbed.deploy import forkserver
from testbed.deploy.deployment import Deployment, LoadDriver
from testbed.deploy.dilation import emulation_plan
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.run_record import PolicyRun
from testbed.engines import EMULATION, SIMULATION, EngineKind
from testbed.faults.timeline import Fault
from testbed.load.trace_replay import probe_replay
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces.workload import Workload


class Run(Protocol):
    def __enter__(self) -> Run: ...
    def __exit__(self, *exc: object) -> None: ...
    def run(self, load: LoadDriver) -> PolicyRun: ...


class EngineRuns(Protocol):
    kind: EngineKind

    def plan(self, sc: Scenario, wl: Workload, speed: float, dilation: float | str | None) -> EmulationPlan: ...

    def deployment(self, sc: Scenario, spec: PolicySpec, plan: EmulationPlan, timeline: Sequence[Fault],
                   impairment: str, logs_to: Path, trace_decisions: bool = False) -> Run: ...


class Emulated:
    kind = EMULATION

    def plan(self, sc: Scenario, wl: Workload, speed: float, dilation: float | str | None) -> EmulationPlan:
        forkserver.prestart()  # importing torch for the workers while the run is prepared
        return emulation_plan(sc, wl, wl.specs(speed), dilation, replay=probe_replay)

    def deployment(self, sc: Scenario, spec: PolicySpec, plan: EmulationPlan, timeline: Sequence[Fault],
                   impairment: str, logs_to: Path, trace_decisions: bool = False) -> Run:
        return Deployment(sc, spec, emulation=plan, impairment=impairment, timeline=timeline, logs_to=logs_to,
                          trace_decisions=trace_decisions)


class Simulated:
    kind = SIMULATION

    def plan(self, sc: Scenario, wl: Workload, speed: float, dilation: float | str | None) -> EmulationPlan:
        return sim_plan(sc, wl.token_scale)

    def deployment(self, sc: Scenario, spec: PolicySpec, plan: EmulationPlan, timeline: Sequence[Fault],
                   impairment: str, logs_to: Path, trace_decisions: bool = False) -> Run:
        return SimDeployment(sc, spec, emulation=plan, timeline=timeline, trace_decisions=trace_decisions)


RUNS: dict[EngineKind, EngineRuns] = {EMULATION: Emulated(), SIMULATION: Simulated()}
