"""``testbed sensitivity`` without a network: the variants it derives (a line, a round trip,
a recipe's mean hit, a load), what it tabulates and plots, and a row equal to the baseline
that is not run again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from testbed.experiments.sensitivity import VARIANTS, Variant, sensitivity, tornado_rows, with_mean_hit, with_wan
from testbed.experiments.trace_run import RunOptions
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate, write_jsonl
from testbed.traces.stats import trace_stats

from .conftest import scenario_with
from .test_report import _saved_run


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = GenConfig(sessions=40, seed=3, duration_s=60.0, outputs_cached=True, arrivals="open", calibrate_scale=16)
    sessions, header = generate(cfg)
    path = tmp_path_factory.mktemp("recipe") / "t.jsonl"
    write_jsonl(path, sessions, header)
    return path


def test_a_line_and_a_round_trip_are_set_on_both_directions() -> None:
    sc = scenario_with()
    fast = with_wan(sc, 100_000, None)
    assert (fast.wan.forward.rate_mbit, fast.wan.reverse.rate_mbit) == (100_000, 100_000)
    assert fast.wan.forward.delay_ms == sc.wan.forward.delay_ms
    near = with_wan(sc, None, 0.2)
    assert (near.wan.forward.delay_ms, near.wan.reverse.delay_ms) == (0.2, 0.2)
    assert near.wan.forward.jitter_ms <= 0.2 and near.source == sc.source


def test_the_recipes_mean_hit_is_bisected_to_the_target(recipe: Path, tmp_path: Path) -> None:
    wl = load_trace(recipe, "sessions", 16)
    base = trace_stats(wl).mean_hit_rate
    for target in (0.80, 0.95):
        got, reached = with_mean_hit(wl, target, tmp_path, None)
        assert abs(reached - target) <= 0.01 and trace_stats(got).mean_hit_rate == pytest.approx(reached)
        assert got.meta["seed"] == wl.meta["seed"]  # the same draw, only the cold share moved
    assert abs(base - 0.80) > 0.05


def test_every_unknown_is_run_tabulated_and_plotted(recipe: Path, tmp_path: Path) -> None:
    sc = scenario_with(emulated=True)
    wl = load_trace(recipe, "sessions", 16)
    calls: list[tuple[float, float, float, int]] = []

    def fake_run(sc_v, wl_v, policies, opts) -> int:  # noqa: ANN001
        # Every TTFT moves with the round trip, the load and the trace's size: the figures
        # follow the variant, as a run's would.
        calls.append((sc_v.wan.forward.delay_ms, sc_v.wan.forward.rate_mbit, opts.speed, len(wl_v.requests)))
        _saved_run(opts.out, shift=sc_v.wan.forward.delay_ms / 10 + (opts.speed - 2.0))
        return 0

    rtt = Variant("rtt-40ms", "RTT", "40 ms", one_way_ms=20.0)
    same_line = Variant("line-now", "line", "as now", rate_mbit=sc.wan.forward.rate_mbit)
    load = next(v for v in VARIANTS if v.name == "load-plus-25")
    opts = RunOptions(dilation=2.0)
    r = sensitivity(sc, wl, 2.0, opts, tmp_path, variants=(same_line, rtt, load), run=fake_run)
    assert len(calls) == 3  # baseline, RTT, load: the line already at that rate is the baseline's row
    assert [v.name for v in r.variants] == ["line-now", "rtt-40ms", "load-plus-25"]
    assert r.variants[0].figures == r.baseline.figures and "(the baseline)" in r.variants[0].level
    base_shift = sc.wan.forward.delay_ms / 10
    rows = {(f, u): (lo, hi) for f, u, lo, hi in tornado_rows(r)}
    assert rows[("cross_p99_s", "RTT")][0] == pytest.approx(2.0 - base_shift)
    assert rows[("cross_p99_s", "load")][0] == pytest.approx(0.5)
    assert rows[("gap_p50_s", "RTT")][0] == pytest.approx(0.0)  # every policy moved alike
    md = (tmp_path / "sensitivity.md").read_text()
    assert "| RTT | 40 ms |" in md and "- cross-dc TTFT P99: RTT" in md
    assert (tmp_path / "tornado.png").stat().st_size > 10_000
    assert (tmp_path / "sensitivity.json").exists() and (tmp_path / "rtt-40ms" / "summary.json").exists()
    assert dataclasses.replace(opts).dilation == 2.0
