"""Sweeps, bathtubs and calibrations rebuilt from their saved points (``testbed report FOLDER``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.analysis import report
from testbed.experiments.hit_rate_sweep import HitPoint, benefit, save_bathtub
from testbed.experiments.load_sweep import save_sweep
from testbed.experiments.repetitions import write_seeded_sweep
from testbed.experiments.sweep_report import Calibration, rebuild_folder, save_calibration

from .conftest import ROOT, run_cli
from .test_seeds import _result


def _tables(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*.md"))}


def _wipe(d: Path) -> None:
    for p in [*d.rglob("*.md"), *d.rglob("*.png")]:
        p.unlink()


def test_a_sweep_over_draws_is_rebuilt_byte_for_byte_by_testbed_report(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    results = [(2, _result(1.0, 1.2, 0.95)), (3, _result(1.0, 1.4, 1.05))]
    for s, r in results:
        save_sweep(r, tmp_path / f"seed-{s}")
    write_seeded_sweep(results, tmp_path)
    before = _tables(tmp_path)
    _wipe(tmp_path)
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 0, err
    assert _tables(tmp_path) == before and set(before) == {"sweep.md", "seed-2/sweep.md", "seed-3/sweep.md"}
    assert (tmp_path / "sweep.png").exists() and (tmp_path / "seed-3" / "sweep.png").exists()


def test_a_bathtub_is_rebuilt_from_its_points(tmp_path: Path) -> None:
    def pt(h: float, policy: str, mean: float, met: float | None) -> HitPoint:
        return HitPoint(hit_target=h, hit_trace=h, hit_measured=None if h == 0 else h, policy=policy, run_dir="x",
                        completed=1, requests=1, ttft_mean_s=mean, ttft_p50_s=mean, ttft_p99_s=mean,
                        slo_attainment=met)

    points = [pt(0.0, "same-dc", 2.0, 0.5), pt(0.0, "pdd:load=4", 1.0, None), pt(0.5, "same-dc", 1.0, 1.0),
              pt(0.5, "pdd:load=4", 1.5, 0.9)]
    save_bathtub(points, benefit(points, "same-dc", "pdd:load=4"), tmp_path, "same-dc", "pdd:load=4")
    before = _tables(tmp_path)
    _wipe(tmp_path)
    assert rebuild_folder(tmp_path) is not None
    assert _tables(tmp_path) == before and "pdd:load=4 against same-dc" in before["bathtub.md"]


@pytest.mark.parametrize("seeds", [[1], [1, 2]])
def test_a_calibration_is_rebuilt_from_its_saved_bisection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          seeds: list[int]) -> None:
    from .test_report import _saved_run

    monkeypatch.setattr(report, "rebuild", lambda run_dir: [])  # the runs' own plots are not the point here
    finals = []
    for s in seeds:
        _saved_run(tmp_path / f"seed-{s}" / "load-2")
        finals.append(str(tmp_path / f"seed-{s}" / "load-2"))
    cal = Calibration(range="1:4", tolerance_s=0.25, seeds=seeds, steps=[(1.0, 1.0), (4.0, 3.0), (2.0, 2.4)],
                      gaps={"1": [1.0] * len(seeds), "4": [3.0] * len(seeds), "2": [2.4] * len(seeds)}, load=2.0,
                      gap_s=2.4, reached=True, finals=finals)
    save_calibration(cal, tmp_path)
    before = (tmp_path / "calibration.md").read_text()
    assert "Calibrated load: 2 x the trace's rate (gap +2.40 s)." in before
    assert ("draws (" in before) == (len(seeds) > 1)
    (tmp_path / "calibration.md").unlink()
    assert rebuild_folder(tmp_path) is not None
    assert (tmp_path / "calibration.md").read_text() == before


def test_a_folder_with_nothing_saved_is_not_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "seed-x").mkdir()
    assert rebuild_folder(tmp_path) is None
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and str(tmp_path) in err


def test_calibrate_saves_what_it_found_and_says_when_not_reached(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``testbed calibrate``'s own path from the bisection to calibration.json/.md (the
    replays stood in for: the bisection is tested in test_seeds)."""
    from testbed.cli import replay_commands as cli_replay
    from testbed.cli.args import build_parser
    from testbed.experiments import load_sweep as sweep

    from .test_report import _saved_run

    monkeypatch.setattr(report, "rebuild", lambda run_dir: [])
    seen_final: list[list | None] = []

    def calibrate(sc: object, ds: list, policies: list, lo: float, hi: float, tol: float, steps: int,
                  opts: sweep.SweepOptions, final_ds: list | None) -> tuple[sweep.Bisection, dict[float, list[float]],
                                                                           list[Path]]:
        seen_final.append(final_ds)
        finals = [opts.out / d.tag / "load-4" for d in (final_ds or ds)]
        for f in finals:
            _saved_run(f)
        gaps = {1.0: [0.5 + 0.1 * i for i in range(len(ds))], 4.0: [1.9 + 0.1 * i for i in range(len(ds))]}
        steps_seen = [(load, sum(g) / len(g)) for load, g in gaps.items()]
        return sweep.Bisection(steps_seen, 4.0, steps_seen[-1][1], False), gaps, finals

    monkeypatch.setattr(sweep, "calibrate", calibrate)
    out = tmp_path / "cal"
    args = build_parser().parse_args(["calibrate", "--trace", str(ROOT / "traces" / "agentic-quick.jsonl"),
                                      "--token-scale", "16", "--limit", "4", "--seeds", "2", "--range", "1:4",
                                      "--out", str(out)])
    assert cli_replay.cmd_calibrate(args) == 1  # not reached: exit 1
    cal = Calibration.model_validate_json((out / "calibration.json").read_text())
    assert cal.seeds == [2, 3] and cal.gaps == {"1": pytest.approx([0.5, 0.6]), "4": pytest.approx([1.9, 2.0])}
    text = (out / "calibration.md").read_text()
    assert "NOT REACHED: no load in 1:4 gives +2.5 s; the closest is 4 (+1.95 s), used below." in text
    assert "| 4.000 | +1.95 s | ± 0.64 s; +1.90, +2.00 |" in text  # t(0.975, 1) x 0.0707 / sqrt(2)
    assert (out / "traces" / "seed-3.jsonl").exists()
    assert seen_final == [None]
    # The figures on more requests and draws than the bisection: 6 requests x 3 draws.
    args = build_parser().parse_args(["calibrate", "--trace", str(ROOT / "traces" / "agentic-quick.jsonl"),
                                      "--token-scale", "16", "--limit", "4", "--range", "1:4", "--final-limit", "6",
                                      "--final-seeds", "3", "--out", str(tmp_path / "cal2")])
    assert cli_replay.cmd_calibrate(args) == 1
    final = seen_final[-1]
    assert final is not None and [d.seed for d in final] == [2, 3, 4]
    assert {len(d.workload.requests) for d in final} == {6}
    cal = Calibration.model_validate_json((tmp_path / "cal2" / "calibration.json").read_text())
    assert cal.seeds == [2] and cal.final_requests == 6 and len(cal.finals) == 3
    assert "over 3 draws, 6 requests each" in (tmp_path / "cal2" / "calibration.md").read_text()


@pytest.mark.parametrize("hit_rate", [None, "0:1:0.5"])
def test_sweep_over_draws_puts_each_draw_in_its_folder_and_tabulates_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hit_rate: str | None) -> None:
    """``testbed sweep --seeds 2``'s own path (the replays stood in for): one dilation for all
    draws, each draw's points in ``seed-<s>/``, the tables over them at the top."""
    import dataclasses

    import pandas as pd

    from testbed.cli import replay_commands as cli_replay
    from testbed.cli.args import build_parser
    from testbed.experiments import hit_rate_sweep as bathtub
    from testbed.experiments import load_sweep as sweep

    seen: list[tuple[int, Path, object]] = []

    def load_sweep(sc: object, wl: object, policies: list, loads: list[float],
                   opts: sweep.SweepOptions) -> sweep.SweepResult:
        seen.append((len(wl.requests), opts.out, opts.run.dilation))  # type: ignore[attr-defined]
        r = _result(1.0, 1.2 + 0.2 * len(seen), 1.0)
        sweep.save_sweep(r, opts.out)
        return r

    def hit_sweep(sc: object, wl: object, policies: list, rates: list[float], load: float,
                  opts: sweep.SweepOptions) -> tuple[list, pd.DataFrame]:
        seen.append((len(wl.requests), opts.out, opts.run.dilation))  # type: ignore[attr-defined]
        curve = pd.DataFrame({"hit_target": rates, "hit_measured": rates, "ttft_mean_change": [-0.1 * len(seen)] * 3,
                              "ttft_p50_change": [0.0] * 3, "slo_points": [1.0] * 3})
        bathtub.save_bathtub([], curve, opts.out, "same-dc", "pdd")
        return [], curve

    monkeypatch.setattr(sweep, "load_sweep", load_sweep)
    monkeypatch.setattr(bathtub, "hit_sweep", hit_sweep)
    monkeypatch.setattr(sweep, "fixed_dilation", lambda sc, wl, run: dataclasses.replace(run, dilation=2.5))
    out = tmp_path / "sw"
    argv = ["sweep", "--trace", str(ROOT / "traces" / "agentic-quick.jsonl"), "--token-scale", "16", "--limit", "5",
            "--seeds", "2", "--out", str(out), "--load", "1" if hit_rate else "1:2:1"]
    assert cli_replay.cmd_sweep(build_parser().parse_args(argv + (["--hit-rate", hit_rate] if hit_rate else []))) == 0
    assert seen == [(5, out / "seed-2", 2.5), (5, out / "seed-3", 2.5)]
    text = (out / ("bathtub.md" if hit_rate else "sweep.md")).read_text()
    assert "over 2 draws" in text and "seeds 2, 3" in text
    if hit_rate:
        assert "| 0.5 | 50.0 % | -15.0 ± 63.5 |" in text  # -10 % and -20 %: t(0.975, 1) x 7.07 = 63.5
    else:
        assert "PDD's SLA throughput over same-dc: +50.0 ± 127.1 % (per draw: +40.0 %, +60.0 %" in text
