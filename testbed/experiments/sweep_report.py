"""Tables and plots of sweeps, bathtubs and calibrations, rebuilt from what they saved.

Each of ``testbed sweep``, ``testbed sweep --hit-rate`` and ``testbed calibrate`` saves its
points (``sweep.json``, ``bathtub_points.csv``, ``calibration.json`` or ``regime.json``; over several draws, one
``seed-<s>/`` folder each) besides the run folders of every point. ``rebuild_folder`` turns
those files back into the tables (``.md``) and plots (``.png``) with the code of the day, so
``testbed report FOLDER`` works on them as it does on a run folder, and nothing is re-run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict

from testbed.analysis.confidence import mean_ci
from testbed.analysis.report import paper_comparison, repetitions_markdown
from testbed.analysis.results import load_run
from testbed.analysis.tables import table_head
from testbed.experiments import prfaas_case
from testbed.experiments.hit_rate_sweep import HitPoint, benefit, compared, save_bathtub
from testbed.experiments.load_sweep import REPORT_P50_GAP_S, SWEEP_FILE, SweepResult, save_sweep
from testbed.experiments.regime import REGIME_FILE, RegimeFit, save_regime
from testbed.experiments.repetitions import write_seeded_bathtub, write_seeded_sweep
from testbed.outputs import write_atomic

CALIBRATION_FILE = "calibration.json"
POINTS_FILE = "bathtub_points.csv"


class Calibration(BaseModel):
    """What ``testbed calibrate`` found: every load tried with each draw's gap, the load
    settled on, and each draw's folder of every policy at that load."""

    model_config = ConfigDict(extra="forbid")

    range: str
    tolerance_s: float
    seeds: list[int]
    steps: list[tuple[float, float]]  # (load, mean gap over the draws), in the order tried
    gaps: dict[str, list[float]]  # load (as text) -> each draw's gap
    load: float
    gap_s: float
    reached: bool
    finals: list[str]  # run folder of each draw at ``load``
    final_requests: int = 0  # requests per draw at ``load`` (0: not recorded)


def calibration_markdown(c: Calibration) -> str:
    many = len(c.seeds) > 1
    what = f"the mean over {len(c.seeds)} draws of the trace (seeds {', '.join(map(str, c.seeds))}) of " if many else ""
    lines = ["# Load calibration", "", f"Bisection of the offered load (x the trace's rate) for {what}cross-dc minus "
             f"same-dc P50 TTFT = +{REPORT_P50_GAP_S:g} s (tolerance {c.tolerance_s:g} s):", "",
             *(table_head(["load", "gap", "95 % interval; per draw"], "rrl") if many
               else table_head(["load", "gap"], "rr"))]
    for load, gap in c.steps:
        if many:
            gaps = c.gaps[f"{load:g}"]
            ci = mean_ci(gaps)
            half = "-" if ci is None or ci.half is None else f"± {ci.half:.2f} s"
            lines.append(f"| {load:.3f} | {gap:+.2f} s | {half}; {', '.join(f'{g:+.2f}' for g in gaps)} |")
        else:
            lines.append(f"| {load:.3f} | {gap:+.2f} s |")
    if c.reached:
        lines += ["", f"Calibrated load: {c.load:g} x the trace's rate (gap {c.gap_s:+.2f} s)."]
    else:
        lines += ["", f"NOT REACHED: no load in {c.range} gives +{REPORT_P50_GAP_S:g} s; the closest is "
                      f"{c.load:g} ({c.gap_s:+.2f} s), used below."]
    finals = [Path(f) for f in c.finals]
    many = len(finals) > 1
    if many:
        runs = [(d, load_run(d)[0]) for d in finals]
        per = f", {c.final_requests} requests each" if c.final_requests else ""
        lines += ["", f"## Every policy at that load, over {len(finals)} draws{per} "
                      f"({', '.join(f'`{d}`' for d in finals)})", "",
                  repetitions_markdown(runs).split("\n", 1)[1].strip()]
    else:
        lines += ["", f"## The report's figures beside this testbed's at that load (`{finals[0]}`)", "",
                  paper_comparison(load_run(finals[0])[0])]
    return "\n".join(lines) + "\n"


def save_calibration(c: Calibration, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / CALIBRATION_FILE, c.model_dump_json(indent=2))
    write_atomic(out / "calibration.md", calibration_markdown(c))
    return [out / CALIBRATION_FILE, out / "calibration.md"]


def load_points(path: Path) -> list[HitPoint]:
    rows = pd.read_csv(path).to_dict("records")
    return [HitPoint(**{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()})
            for r in rows]


def _rebuild_bathtub(d: Path) -> tuple[list[Path], pd.DataFrame, tuple[str, str]]:
    points = load_points(d / POINTS_FILE)
    base, pdd = compared(list(dict.fromkeys(p.policy for p in points)))
    curve = benefit(points, base, pdd)
    return save_bathtub(points, curve, d, base, pdd), curve, (base, pdd)


def rebuild_folder(d: Path) -> list[Path] | None:
    """Rewrite the tables and plots of a saved sweep, bathtub or calibration folder (or of
    their draws); ``None`` when ``d`` holds none of them."""
    if prfaas_case.is_case(d):
        return prfaas_case.write_case(d)
    if (d / REGIME_FILE).exists():
        return save_regime(RegimeFit.model_validate_json((d / REGIME_FILE).read_text()), d)
    if (d / CALIBRATION_FILE).exists():
        return save_calibration(Calibration.model_validate_json((d / CALIBRATION_FILE).read_text()), d)
    if (d / SWEEP_FILE).exists():
        return save_sweep(SweepResult.model_validate_json((d / SWEEP_FILE).read_text()), d)
    if (d / POINTS_FILE).exists():
        return _rebuild_bathtub(d)[0]
    draws = sorted((int(x.name.removeprefix("seed-")), x) for x in d.glob("seed-*")
                   if x.is_dir() and x.name.removeprefix("seed-").isdigit())
    if draws and all((x / SWEEP_FILE).exists() for _, x in draws):
        results = [(s, SweepResult.model_validate_json((x / SWEEP_FILE).read_text())) for s, x in draws]
        paths = [p for (_, r), (_, x) in zip(results, draws, strict=True) for p in save_sweep(r, x)]
        return paths + write_seeded_sweep(results, d)
    if draws and all((x / POINTS_FILE).exists() for _, x in draws):
        built = [(s, _rebuild_bathtub(x)) for s, x in draws]
        return [p for _, (ps, _, _) in built for p in ps] + write_seeded_bathtub(
            [(s, curve) for s, (_, curve, _) in built], d, *built[0][1][2])
    return None
