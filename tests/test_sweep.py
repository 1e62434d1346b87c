"""Load sweeps: the range grammar, bisection, SLA throughput and the sweep's tables, from
synthetic responses and fixed points (no replay)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from testbed.analysis.results import load_run
from testbed.errors import InputError
from testbed.experiments.load_sweep import (
    LoadPoint,
    SlaThroughput,
    SweepResult,
    bisect_increasing,
    p50_gap,
    parse_range,
    save_sweep,
    sla_throughput,
    sweep_markdown,
)

from .conftest import ROOT


def test_parse_range_includes_the_end_on_the_grid() -> None:
    assert parse_range("0.5:2:0.5", "--load") == [0.5, 1.0, 1.5, 2.0]
    assert parse_range("1:1:1", "--load") == [1.0]
    assert parse_range("0:1:0.3", "--load") == [0.0, 0.3, 0.6, 0.9]
    for bad in ("1", "1:2", "a:b:c", "2:1:1", "0:1:0", "-1:1:1", "0:1000:1"):
        with pytest.raises(InputError, match="--load"):
            parse_range(bad, "--load")


@pytest.mark.parametrize("target", [0.3, 2.5, 7.0])
def test_bisection_finds_the_load_of_a_monotone_response(target: float) -> None:
    f = lambda x: 3.0 * math.log(x) + 1.0  # noqa: E731 - increasing, spans orders of magnitude
    b = bisect_increasing(f, target, 0.1, 30.0, tol=0.05, max_steps=20)
    assert b.reached and abs(b.value - target) <= 0.05
    assert abs(b.load - math.exp((target - 1.0) / 3.0)) / b.load < 0.05
    assert len(b.steps) <= 20 and b.steps[0][0] == 0.1 and b.steps[1][0] == 30.0


def test_bisection_says_when_the_target_is_out_of_range_and_gives_the_closest() -> None:
    f = lambda x: x  # noqa: E731
    high = bisect_increasing(f, 10.0, 0.5, 4.0, tol=0.1)
    assert not high.reached and high.load == 4.0 and len(high.steps) == 2
    low = bisect_increasing(f, 0.1, 0.5, 4.0, tol=0.1)
    assert not low.reached and low.load == 0.5 and len(low.steps) == 2  # the ends go together


def test_bisection_stops_after_max_steps_with_the_closest_and_survives_noise() -> None:
    rng = random.Random(3)
    f = lambda x: x + rng.uniform(-0.2, 0.2)  # noqa: E731
    b = bisect_increasing(f, 2.0, 0.25, 8.0, tol=0.01, max_steps=6)
    assert len(b.steps) == 6
    assert b.load == min(b.steps, key=lambda s: abs(s[1] - 2.0))[0]
    assert 1.0 < b.load < 3.5
    with pytest.raises(InputError):
        bisect_increasing(f, 1.0, 2.0, 1.0, tol=0.1)


def _point(load: float, policy: str, met: float | None, p50: float | None = 1.0, rps: float = 1.0) -> LoadPoint:
    return LoadPoint(load=load, policy=policy, run_dir=f"load-{load:g}", requests=10, completed=10, failed=0,
                     rps=rps * load, slo_attainment=met, ttft_p50_s=p50, ttft_p90_s=p50, ttft_p99_s=p50,
                     tpot_p50_s=0.05, fidelity_passed=True)


def test_sla_throughput_is_the_highest_load_before_the_first_miss() -> None:
    pts = [_point(0.5, "same-dc", 1.0), _point(1.0, "same-dc", 0.95), _point(1.5, "same-dc", 0.7),
           _point(2.0, "same-dc", 0.92),  # noise past the knee does not count
           _point(0.5, "pdd", 1.0), _point(1.0, "pdd", 1.0), _point(1.5, "pdd", 0.9), _point(2.0, "pdd", 0.5)]
    base, pdd = sla_throughput(pts, "same-dc", 0.9), sla_throughput(pts, "pdd", 0.9)
    assert (base.load, base.rps) == (1.0, 1.0)
    assert (pdd.load, pdd.rps) == (1.5, 1.5)
    none = sla_throughput([_point(0.5, "x", 0.2), _point(1.0, "x", None)], "x", 0.9)
    assert none.load is None and none.rps is None


def test_sweep_tables_give_the_gain_and_bcr_and_are_saved(tmp_path: Path) -> None:
    pts = [_point(1.0, "same-dc", 1.0), _point(2.0, "same-dc", 0.5), _point(1.0, "pdd", 1.0), _point(2.0, "pdd", 1.0)]
    sla = [SlaThroughput(policy="same-dc", share=0.9, load=1.0, rps=1.0, cost=88.0, bcr=1.0 / 88),
           SlaThroughput(policy="pdd", share=0.9, load=2.0, rps=2.0, cost=83.35, bcr=2.0 / 83.35)]
    r = SweepResult(dilation=2.0, slo_ttft_s=5, slo_tpot_s=0.25, share=0.9, points=pts, sla=sla)
    md = sweep_markdown(r)
    assert "+100.0 % (the report: +27.8 %)" in md
    assert f"BCR over same-dc: {100 * (2 / 83.35 * 88 - 1):+.1f} %" in md
    # PDD met the objectives at the top of the sweep: its figure is a lower bound, said so.
    assert "Lower bound: pdd met the objectives at the highest load swept (2x)" in md
    capped = r.model_copy(update={"points": [*pts, _point(3.0, "same-dc", 0.1), _point(3.0, "pdd", 0.1)]})
    assert "Lower bound" not in sweep_markdown(capped)
    paths = save_sweep(r, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    assert SweepResult.model_validate_json((tmp_path / "sweep.json").read_text()) == r
    assert len(pd.read_csv(tmp_path / "sweep.csv")) == 4


def test_p50_gap_needs_both_baselines() -> None:
    pts = [_point(1.0, "same-dc", 1.0, p50=4.2), _point(1.0, "cross-dc:x=1", 1.0, p50=6.7)]
    assert p50_gap(pts) == pytest.approx(2.5)
    with pytest.raises(InputError, match="same-dc and cross-dc"):
        p50_gap(pts[:1])


@pytest.mark.parametrize("h", [0.0, 0.2, 0.55, 0.9, 1.0])
def test_a_rewritten_trace_has_the_hit_rate_asked_and_keeps_lengths_and_timing(h: float) -> None:
    from testbed.experiments.hit_rate_sweep import with_hit_rate
    from testbed.traces import load_trace
    from testbed.traces.stats import hit_rates

    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16)
    out = with_hit_rate(wl, h)
    assert [r.input_len for r in out.requests] == [r.input_len for r in wl.requests]
    assert [(r.rid, r.at, r.after, r.delay, r.output_len) for r in out.requests] == \
           [(r.rid, r.at, r.after, r.delay, r.output_len) for r in wl.requests]
    rates = hit_rates(out)
    warm = sorted(rates.values())[len(rates) // 10:]  # past the first requests' warm-up of the cache
    mean = sum(warm) / len(warm)
    # hits count whole blocks of the trace's block size, so a prompt's hit is h less up to a block
    block_share = max(out.block_size / r.input_len for r in out.requests)
    assert h - block_share - 0.02 <= mean <= h + 1e-9, (h, mean)
    assert out.meta["hit_rate"] == h


def test_the_bathtub_benefit_is_pdd_against_the_baseline_per_rate() -> None:
    from testbed.experiments.hit_rate_sweep import HitPoint, benefit

    def pt(h: float, policy: str, mean: float, met: float) -> HitPoint:
        return HitPoint(hit_target=h, hit_trace=h, hit_measured=h, policy=policy, run_dir="x", completed=1,
                        requests=1, ttft_mean_s=mean, ttft_p50_s=mean, ttft_p99_s=mean, slo_attainment=met)

    pts = [pt(0.2, "same-dc", 2.0, 0.5), pt(0.2, "pdd", 1.0, 0.8), pt(0.9, "same-dc", 1.0, 1.0),
           pt(0.9, "pdd", 1.5, 0.9), pt(0.5, "pdd", 1.0, 1.0)]  # no baseline at 0.5: no row
    curve = benefit(pts, "same-dc", "pdd")
    assert list(curve.hit_target) == [0.2, 0.9]
    assert list(curve.ttft_mean_change) == pytest.approx([-0.5, 0.5])
    assert list(curve.slo_points) == pytest.approx([30.0, -10.0])


@pytest.mark.slow
def test_a_small_load_sweep_end_to_end(tmp_path: Path) -> None:
    """The real entry point, in the simulator (no root), its loads side by side (--jobs 2)."""
    sessions = [{"session": f"w{i}", "start_s": 0.5 * i, "shared_prefix": {"id": "sys", "tokens": 96},
                 "turns": [{"new_tokens": 40, "output_tokens": 6},
                           {"new_tokens": 12, "output_tokens": 6, "delay_s": 0.3}]} for i in range(3)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in sessions))
    out = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "testbed", "sweep", "--trace", str(trace), "--policies", "same-dc",
                          "--load", "1:2:1", "--token-scale", "2", "--engine", "sim", "--jobs", "2", "--slo-ttft", "60",
                          "--slo-tpot", "10", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = SweepResult.model_validate_json((out / "sweep.json").read_text())
    assert r.dilation == 1.0 and [(p.load, p.policy) for p in r.points] == [(1.0, "same-dc"), (2.0, "same-dc")]
    one, two = r.points
    assert one.completed == two.completed == 6 and one.slo_attainment == two.slo_attainment == 1.0
    assert one.rps is not None and two.rps is not None and two.rps > one.rps
    for p in r.points:  # every load is a saved run of its own, at the load asked
        summary, _ = load_run(Path(p.run_dir))
        assert summary.speed == p.load and summary.engine == "sim"
    assert r.sla[0].load == 2.0 and r.sla[0].rps == two.rps  # both loads met the (loose) objectives
    assert all((out / f).stat().st_size > 0 for f in ("sweep.csv", "sweep.md", "sweep.png"))
    assert "## SLA throughput" in res.stdout
