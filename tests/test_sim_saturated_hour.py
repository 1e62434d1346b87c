"""The simulator through an emulated hour on a line saturated most of the time (no root): a
cold open-loop trace generated here (mean hit near 50 %, prompts of ~33K tokens) on
``paper.yaml`` with a line too slow for it, every policy. A long simulated replay once ended
every prefill worker: a BBR connection's window doubled every round trip of each probe for
its minimum RTT (four segments are a window any share exceeds), 2^500 in this hour, until
a float conversion overflowed in a longer one. Now every request ends (completed, or
failed with a reason), no component raises, no worker dies, and no window outgrows what
its path holds."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.sim.flows import Flows
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate_file

from .conftest import TOPOLOGIES

TOKEN_SCALE = 32
HOUR_S = 3600.0
LINE_MBIT = 2000  # the cold requests' KV would need ~5 Gbit/s on average: cross-dc queues on it all hour


@pytest.fixture(scope="module")
def cold_hour(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cold") / "cold-hour.jsonl"
    generate_file(GenConfig(seed=7, duration_s=HOUR_S, rps=0.3, arrivals="open", above_95=0.05,
                            anomalous_share=0.45), path, "mooncake")
    return path


@pytest.mark.parametrize("policy", ["same-dc", "cross-dc", "pdd"])
def test_an_hour_on_a_saturated_line_ends_every_request_and_keeps_every_worker(
        cold_hour: Path, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = load_scenario(TOPOLOGIES / "paper.yaml", {"wan": {"forward": {"rate_mbit": LINE_MBIT},
                                                           "reverse": {"rate_mbit": LINE_MBIT}}})
    wl = load_trace(cold_hour, "auto", TOKEN_SCALE)
    over: list[float] = [0.0]  # the widest window seen, as a share of its path's bound
    reschedule = Flows.reschedule

    def watched(self: Flows) -> None:
        reschedule(self)
        for f in self.active:
            over[0] = max(over[0], f.conn.cwnd / f.conn.path.max_cwnd)

    monkeypatch.setattr(Flows, "reschedule", watched)
    t0 = time.monotonic()
    with SimDeployment(sc, parse_policy(policy), emulation=sim_plan(sc, TOKEN_SCALE)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 2 * HOUR_S, show_progress=False))
    wall = time.monotonic() - t0
    assert len(run.recs) == len(wl.requests) > 900
    assert all(r.ok or r.error for r in run.recs.values())  # every request ended, a failure with its reason
    assert run.component_errors == [] and run.deaths == [], (run.component_errors, run.deaths)
    assert set(run.workers) == set(dep.configs)  # every worker reported its statistics at the end
    assert math.isfinite(over[0]) and over[0] <= 1.0
    last = max(r.ended for r in run.recs.values() if r.ended) - run.fault_t0
    assert last > 0.95 * HOUR_S  # it did run the hour
    if policy == "cross-dc":  # every request's KV crosses: the line is the queue for most of the hour
        line = run.wan_line["a->b"]
        full = dep.links.wan[("a", "b")].capacity * line.bin_s  # wire payload bytes a bin holds
        assert sum(b >= 0.9 * full for b in line.bytes) * line.bin_s > 0.8 * HOUR_S, "the line was not saturated"
    if policy != "same-dc":
        assert over[0] > 0  # windows were watched: flows crossed the line
    assert wall < 60
