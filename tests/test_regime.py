"""The two-unknown calibration (``testbed calibrate --fit load,prefill``) on synthetic
responses with a known answer: the search converges to it, says when the targets are out of
reach, and prints its path."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from testbed.experiments.regime import REPORT_CROSS_P50_S, REPORT_SAME_P50_S, fit_two


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
