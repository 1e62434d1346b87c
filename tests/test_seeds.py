"""Repetitions over draws of a generated trace (``--seeds``): the draws themselves, and the
tables over them, from fixed points (no replay)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from testbed.analysis import report
from testbed.analysis.results import load_run
from testbed.errors import InputError
from testbed.experiments.load_sweep import LoadPoint, SlaThroughput, SweepResult
from testbed.experiments.repetitions import (
    draws,
    seeded_bathtub,
    seeded_sweep_markdown,
    write_seeded_bathtub,
    write_seeded_sweep,
)
from testbed.traces import load_trace
from testbed.traces.generate import same_recipe

from .conftest import ROOT

QUICK = ROOT / "traces" / "agentic-quick.jsonl"


def test_draws_of_a_generated_trace_follow_its_recipe_with_the_next_seeds(tmp_path: Path) -> None:
    wl = load_trace(QUICK, "auto", 16).select(10, None)
    ds = draws(wl, 3, tmp_path, 10, None)
    assert [d.seed for d in ds] == [2, 3, 4]  # the file's own seed first: the file as shipped
    assert ds[0].workload is wl
    lengths = []
    for d in ds[1:]:
        path = tmp_path / "traces" / f"{d.tag}.jsonl"
        header = json.loads(path.read_text().splitlines()[0])
        assert header["seed"] == d.seed and same_recipe(header, wl.meta)
        assert d.workload.source == path and d.workload.token_scale == 16 and len(d.workload.requests) == 10
        lengths.append([r.input_len for r in d.workload.requests])
    assert [r.input_len for r in wl.requests] not in lengths and lengths[0] != lengths[1]  # other samples
    # Drawing again gives the same draw: a repetition can be rebuilt from its seed.
    again = draws(wl, 2, tmp_path / "again", 10, None)[1]
    assert [r.input_len for r in again.workload.requests] == lengths[0]


def test_a_trace_without_a_recipe_is_one_sample(tmp_path: Path) -> None:
    wl = load_trace(ROOT / "traces" / "mooncake-sample.jsonl", "auto", 1)
    assert len(draws(wl, 1, tmp_path, None, None)) == 1
    with pytest.raises(InputError, match="mooncake-sample.jsonl: --seeds above 1 needs a trace written by"):
        draws(wl, 2, tmp_path, None, None)
    with pytest.raises(InputError, match="--seeds: at least 1"):
        draws(wl, 0, tmp_path, None, None)
    assert not same_recipe(wl.meta, wl.meta)  # no generator, no recipe


def _result(rps_same: float, rps_pdd: float | None, met: float) -> SweepResult:
    def pt(policy: str, p50: float) -> LoadPoint:
        return LoadPoint(load=1.0, policy=policy, run_dir="x", requests=10, completed=10, failed=0, rps=1.0,
                         slo_attainment=met, ttft_p50_s=p50, ttft_p90_s=p50, ttft_p99_s=2 * p50, tpot_p50_s=0.05,
                         fidelity_passed=True)
    sla = [SlaThroughput(policy="same-dc", share=0.9, load=1.0, rps=rps_same, cost=88.0, bcr=rps_same / 88),
           SlaThroughput(policy="pdd", share=0.9, load=1.0 if rps_pdd else None, rps=rps_pdd, cost=83.35,
                         bcr=None if rps_pdd is None else rps_pdd / 83.35)]
    return SweepResult(dilation=2.0, slo_ttft_s=5, slo_tpot_s=0.25, share=0.9,
                       points=[pt("same-dc", 1.0 + met), pt("pdd", met)], sla=sla)


def test_the_sweep_over_draws_gives_means_intervals_and_n(tmp_path: Path) -> None:
    results = [(2, _result(1.0, 1.2, 0.95)), (3, _result(1.0, 1.3, 1.05)), (4, _result(1.0, 1.4, 1.15))]
    md = seeded_sweep_markdown(results)
    assert "over 3 draws of the trace (seeds 2, 3, 4" in md
    # SLO met 95, 105, 115 %: mean 105, half-width t(0.975, 2) x 10 / sqrt(3) = 24.8.
    assert "| 1 | pdd | 105 ± 25 | 1.05 ± 0.25 | 2.10 ± 0.50 | 3/3 |" in md
    assert "| pdd | 1.00 ± 0.00 | 1.300 ± 0.248 | 0.01560 ± 0.00298 |" in md
    assert "PDD's SLA throughput over same-dc: +30.0 ± 24.8 % (per draw: +20.0 %, +30.0 %, +40.0 %" in md
    # A draw where PDD met the objectives at no load has no gain: the mean is over the others, n says so.
    md = seeded_sweep_markdown([*results, (5, _result(1.0, None, 0.5))])
    assert "PDD's SLA throughput over same-dc: +30.0 ± 24.8 % (n=3) (per draw: +20.0 %, +30.0 %, +40.0 %, -;" in md
    paths = write_seeded_sweep(results, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    assert sorted(pd.read_csv(tmp_path / "sweep_seeds.csv").seed) == [2, 2, 3, 3, 4, 4]


def test_the_bathtub_over_draws_gives_each_rates_mean_and_interval(tmp_path: Path) -> None:
    def curve(shift: float) -> pd.DataFrame:
        return pd.DataFrame({"hit_target": [0.0, 0.5], "hit_measured": [0.0, 0.5],
                             "ttft_mean_change": [-0.2 + shift, -0.4 + shift],
                             "ttft_p50_change": [-0.1, None], "slo_points": [10.0 + 100 * shift, 0.0],
                             # packed prefill passes: how full PDD's ran (same-dc's prefill ran unpacked)
                             "pass_fill": [0.9 + shift, 0.5], "base_pass_fill": [None, None]})
    curves = [(2, curve(-0.1)), (3, curve(0.0)), (4, curve(0.1))]
    agg = seeded_bathtub(curves)
    assert list(agg.hit_target) == [0.0, 0.5] and list(agg.n) == [3, 3]
    assert list(agg.ttft_mean_change) == pytest.approx([-0.2, -0.4])
    assert agg.ttft_mean_change_half[0] == pytest.approx(4.303 * 0.1 / 3**0.5)
    assert agg.ttft_p50_change_half[0] == pytest.approx(0.0) and pd.isna(agg.ttft_p50_change[1])
    write_seeded_bathtub(curves, tmp_path, "same-dc", "pdd")
    md = (tmp_path / "bathtub.md").read_text()
    assert "over 3 draws (seeds 2, 3, 4)" in md
    assert "| 0 | 0.0 % | -20.0 ± 24.8 | -10.0 ± 0.0 | +10.0 ± 24.8 | 90 % / - | 3 |" in md
    assert "| 0.5 | 50.0 % | -40.0 ± 24.8 | - | +0.0 ± 0.0 | 50 % / - | 3 |" in md
    assert (tmp_path / "bathtub.png").stat().st_size > 0


@pytest.fixture
def no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved runs without their report and plots (seconds each; these tests read summaries)."""
    monkeypatch.setattr(report, "rebuild", lambda run_dir: [])


def test_runs_of_draws_of_one_recipe_are_repetitions(tmp_path: Path, no_plots: None) -> None:
    from .test_report import _saved_run

    recipe = json.loads(QUICK.read_text().splitlines()[0])
    dirs = []
    for seed in (2, 3, 4):
        d = tmp_path / f"seed-{seed}"
        s = _saved_run(d)
        meta = {k: v for k, v in recipe.items() if k not in ("format", "version")}
        trace = s.trace.model_copy(update={"trace": f"traces/seed-{seed}.jsonl", "meta": {**meta, "seed": seed}})
        (d / "summary.json").write_text(s.model_copy(update={"trace": trace}).model_dump_json())
        dirs.append(d)
    runs = [(d, load_run(d)[0]) for d in dirs]
    assert "on 3 draws of one trace recipe (seeds 2, 3, 4) (n = 3)" in report.repetitions_markdown(runs)
    # Another recipe is another setup.
    other = runs[2][1]
    changed = other.trace.model_copy(update={"meta": {**other.trace.meta, "sessions": 99}})
    with pytest.raises(InputError, match="not a repetition of .*: trace"):
        report.repetitions_markdown([*runs[:2], (dirs[2], other.model_copy(update={"trace": changed}))])


def test_calibration_over_draws_bisects_their_mean_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       no_plots: None) -> None:
    from testbed.experiments import load_sweep as sweep
    from testbed.experiments.load_sweep import Draw
    from testbed.policies import parse_policy_list

    from .test_report import _saved_run

    calls: list[tuple[str, float, tuple[str, ...]]] = []

    def run_point(sc: object, wl: int, policies: list, load: float, run: object, out: Path) -> list[LoadPoint]:
        # A stand-in for a replay: draw k's cross-dc is k x load seconds slower than same-dc.
        labels = tuple(p.label for p in policies)
        run_dir = out / f"load-{load:g}"
        _saved_run(run_dir, only=labels)
        calls.append((str(out.relative_to(tmp_path)), load, labels))
        p50 = {"same-dc": 1.0, "cross-dc": 1.0 + wl * load}
        return [LoadPoint(load=load, policy=label, run_dir=str(run_dir), requests=1, completed=1, failed=0, rps=1.0,
                          slo_attainment=1.0, ttft_p50_s=p50.get(label, 0.5), ttft_p90_s=None, ttft_p99_s=None,
                          tpot_p50_s=None, fidelity_passed=True) for label in labels]

    monkeypatch.setattr(sweep, "run_point", run_point)
    monkeypatch.setattr(sweep, "fixed_dilation", lambda sc, wl, run: run)
    ds = [Draw(1, 1), Draw(2, 2)]  # type: ignore[arg-type]  # gaps: load and 2 x load, mean 1.5 x load
    b, gaps, finals = sweep.calibrate(None, ds, parse_policy_list("same-dc,cross-dc,pdd"),  # type: ignore[arg-type]
                                      0.5, 4.0, 0.05, 12, sweep.SweepOptions(None, tmp_path))  # type: ignore[arg-type]
    assert b.reached and abs(b.load - 2.5 / 1.5) / b.load < 0.05
    assert all(gaps[load] == pytest.approx([load, 2 * load]) for load, _ in b.steps)
    assert [g for _, g in b.steps] == pytest.approx([1.5 * load for load, _ in b.steps])
    bisection = [c for c in calls if c[0].startswith("bisection")]
    assert {c[0] for c in bisection} == {"bisection/seed-1", "bisection/seed-2"}
    assert all(c[2] == ("same-dc", "cross-dc") for c in bisection)
    # At the load found only PDD runs again, once per draw, and each draw's folder holds all three.
    assert [c for c in calls if c[0].startswith("rest")] == [("rest/seed-1", b.load, ("pdd",)),
                                                             ("rest/seed-2", b.load, ("pdd",))]
    assert finals == [tmp_path / f"seed-{s}" / f"load-{b.load:g}" for s in (1, 2)]
    for d in finals:
        assert list(load_run(d)[0].policies) == ["same-dc", "cross-dc", "pdd"]
