"""``testbed tune``'s search on a stand-in for the runs (no root): the defaults come first, the
sampler moves towards better knobs, the front and the best are the measured ones, the
defaults and the best are repeated on every draw, and everything is saved."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from testbed.experiments import tune as tune_mod
from testbed.experiments.load_sweep import Draw
from testbed.experiments.trace_run import RunOptions
from testbed.experiments.tune import TrialPoint, TuneOptions, defaults, search_space, tune
from testbed.policies import parse_policy
from testbed.policies.pdd import Pdd
from testbed.scenario import load_scenario
from testbed.traces import load_trace

from .conftest import ROOT, TOPOLOGIES


def _stand_in(monkeypatch: pytest.MonkeyPatch, runs: list[tuple[str, Path]]) -> None:
    """Runs that cost nothing: goodput peaks at relay_s = 1.2 with catch-up handoffs; P99 grows
    with relay_s. A draw (run folder named after it) shifts goodput by a little."""
    monkeypatch.setattr(tune_mod, "fixed_dilation", lambda sc, wl, opts: dataclasses.replace(opts, dilation=2.0))
    monkeypatch.setattr(tune_mod, "run_trace", lambda sc, wl, specs, opts: runs.append((specs[0].label, opts.out)))

    def point(sc: Any, spec: Any, number: int, knobs: dict[str, Any], run_dir: Path, seed: int | None = None
              ) -> TrialPoint:
        o = spec.options
        good = 2.0 - (o["relay_s"] - 1.2) ** 2 + (0.3 if o["handoff"] == "catch-up" else 0.0)
        good += 0.01 * (seed or 0)
        return TrialPoint(number=number, knobs=knobs, spec=spec.label, run_dir=str(run_dir), goodput_rps=good,
                          price_per_h=1.0, goodput_per_price=good, ttft_p99_s=1.0 + o["relay_s"], slo_attainment=0.9,
                          failed=0, fidelity_passed=True, seed=seed)

    monkeypatch.setattr(tune_mod, "_point", point)


def test_the_search_starts_at_the_defaults_and_keeps_the_front_the_best_and_their_draws(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs: list[tuple[str, Path]] = []
    _stand_in(monkeypatch, runs)
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16)
    draws = [Draw(2, wl), Draw(3, wl), Draw(4, wl)]
    r = tune(sc, wl, draws, TuneOptions(parse_policy("pdd"), trials=16, seeds=3, run=RunOptions()), tmp_path)
    assert [t.number for t in r.trials] == list(range(16))
    assert r.trials[0].knobs == defaults(Pdd, search_space(Pdd)) and runs[0][0].startswith("pdd")
    assert set(r.trials[0].knobs) == {"handoff", "relay_s", "threshold", "load", "cutoff"}  # as PddOptions says
    best = max(r.trials, key=lambda t: t.goodput_per_price or 0)
    assert r.best == best.number and best.goodput_per_price > r.trials[0].goodput_per_price  # beat the defaults
    # The front: no trial beats a front trial on both objectives, and the best is on it.
    for f in (t for t in r.trials if t.number in r.front):
        assert not any((t.goodput_per_price or 0) > (f.goodput_per_price or 0)
                       and (t.ttft_p99_s or 0) < (f.ttft_p99_s or 0) for t in r.trials)
    assert r.best in r.front
    # The defaults and the best, each on every draw: the first draw is the trial itself.
    assert {k: [p.seed for p in v] for k, v in r.repeated.items()} == {"defaults": [2, 3, 4], "best": [2, 3, 4]}
    assert len(runs) == 16 + 2 * 2
    assert {p.name for p in tmp_path.iterdir()} >= {"tune.json", "tune.md", "tune.png", "trials.json"}
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert saved["best"] == r.best and len(saved["trials"]) == 16
    md = (tmp_path / "tune.md").read_text()
    assert "(defaults)" in md or 0 not in r.front
    assert "± " in md  # intervals over the draws


def test_a_policy_without_knobs_is_refused(tmp_path: Path) -> None:
    from testbed.errors import InputError

    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16)
    with pytest.raises(InputError, match="no knobs"):
        tune(sc, wl, [Draw(2, wl)], TuneOptions(parse_policy("cross-dc")), tmp_path)
