"""The two-unknown calibration (``testbed calibrate --fit load,prefill``) on synthetic
responses with a known answer: the search converges to it, says when the targets are out of
reach, and prints its path."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from testbed.analysis.results import load_run
from testbed.errors import InputError
from testbed.experiments.load_sweep import Draw
from testbed.experiments.regime import (
    REPORT_CROSS_P50_S,
    REPORT_SAME_P50_S,
    RegimeFit,
    fit_two,
    prefill_accelerators,
    whatif_shares,
)
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.policies import parse_policy_list
from testbed.scenario import load_scenario
from testbed.traces.formats import load_trace

from .conftest import ROOT, TOPOLOGIES


def _model(calls: list[tuple[str, float, float]]):  # type: ignore[no-untyped-def]
    """same-dc's P50 grows with load x compute (the baseline queues); cross-dc adds a line
    whose delay grows with the load alone. Known answer: load 2.5/3, cost 2.1 x 3/2.5."""
    def p50(policy: str, points: Sequence[tuple[float, float]]) -> list[float]:
        out = []
        for c, load in points:
            calls.append((policy, c, load))
            same = 2.0 * load * c
            out.append(same if policy == "same-dc" else same + 3.0 * load)
        return out
    return p50


def test_the_two_target_fit_finds_the_known_load_and_prefill_cost() -> None:
    calls: list[tuple[str, float, float]] = []
    # cross-dc's tolerance holds same-dc's (its error carries into cross-dc's P50) and its own
    load, compute, same, cross, reached = fit_two(_model(calls), (0.05, 20.0), (0.5, 50.0), (0.02, 0.05), 30, 20)
    assert reached
    assert abs(same - REPORT_SAME_P50_S) <= 0.02 and abs(cross - REPORT_CROSS_P50_S) <= 0.05
    assert load == pytest.approx(2.5 / 3, rel=0.02) and compute == pytest.approx(2.1 * 3 / 2.5, rel=0.03)
    # cross-dc is evaluated once per cost tried, at the load its inner search found
    assert sum(p == "cross-dc" for p, _, _ in calls) <= 20


def test_the_fit_says_when_no_cost_in_the_range_reaches_the_targets() -> None:
    # At a cost of at most 1, same-dc needs load >= 2.1 for 4.2 s: cross-dc is then >= 10.5 s.
    load, compute, same, cross, reached = fit_two(_model([]), (0.05, 20.0), (0.1, 1.0), (0.02, 0.02), 30, 8)
    assert not reached and compute == 1.0 and cross > REPORT_CROSS_P50_S


def test_the_whatif_replays_pdd_at_each_prefill_share_and_tables_it_against_same_dc(tmp_path: Path) -> None:
    """The what-if of the fitted point (in the simulator, 30 requests): the scenario's own
    share is the point itself (no replay, the finals' PDD); a baseline with fewer prefill
    accelerators means a cheaper model, so PDD (which keeps them all) gains on same-dc."""
    sc = load_scenario(TOPOLOGIES / "paper.yaml")
    total = prefill_accelerators(sc)
    assert total == 40  # 5 instances x 8 H100
    wl = load_trace(ROOT / "traces" / "agentic-quick.jsonl", "auto", 16).select(30)
    cost, load = 16.0, 1.0
    opts = RunOptions(engine="sim", allow_infidelity=True)
    final = tmp_path / "final"
    run_trace(sc.with_prefill_cost(cost), wl, parse_policy_list("same-dc,pdd"),
              dataclasses.replace(opts, speed=load, out=final))
    fit = RegimeFit(load_range=(0.5, 2), prefill_cost_range=(1, 32), tolerance_s=(0.1, 0.2), requests=30, probes=[],
                    load=load, prefill_cost=cost, same_p50_s=4.2, cross_p50_s=6.7, reached=True, finals=[str(final)],
                    final_requests=30)
    fit = whatif_shares(sc, fit, [Draw(0, wl)], opts, tmp_path, [10, total])
    ten, own = fit.whatif
    assert (ten.share, ten.pdd_prefill_cost, own.pdd_prefill_cost) == (10, pytest.approx(4.0), pytest.approx(16.0))
    assert own.runs == [str(final)] and not (tmp_path / "whatif" / f"share-{total}").exists()
    assert (tmp_path / "whatif" / "share-10" / "summary.json").exists()
    point = load_run(final)[0].policies
    assert own.vs_same["mean"][0] == pytest.approx(point["pdd"].ttft_mean_s / point["same-dc"].ttft_mean_s - 1)
    assert ten.vs_same["mean"][0] < own.vs_same["mean"][0]  # a quarter of the prefill cost: PDD far ahead
    table = (tmp_path / "regime.md").read_text()
    assert "## What the baseline's prefill share would make true" in table
    assert "| 10 | x4 |" in table and f"| {total} | x16 |" in table
    with pytest.raises(InputError, match="a share is a positive number"):
        whatif_shares(sc, fit, [Draw(0, wl)], opts, tmp_path, [0])
