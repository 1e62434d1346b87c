"""Invariants of the emulation (root): what a run reports depends on the emulated system, not
on how it was emulated. Modeled compute reports what real compute reports (both are paced
to the same device; only the tokens differ), and a modeled cluster reports the same faster
than real time (D 0.75) as slower (D 2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from testbed.analysis.metrics import request_rows
from testbed.deploy.deployment import Deployment
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fidelity import allowed
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import Scenario
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model import ensure_default_model
from workers.model_dir import kv_bytes_per_token

from .conftest import needs_root, scenario_with

# Latencies measured on this host compared within 10 %: run alone (make test's serial part).
pytestmark = pytest.mark.serial

SERVING = ("prefill", "relay", "decode-a", "decode-b")
STATS = ("ttft_s", "tpot_s")


def _scenario(compute: str) -> Scenario:
    hosts = {h: {"compute": compute} for h in SERVING}
    b = {"decode-b": hosts.pop("decode-b")}
    # A buffer of 4 round trips, which slow start does not overflow: a dropped frame would be
    # recovered on the kernel's timers, which no dilation stretches (docs/emulated-time.md).
    # 500 Mbit/s: TTFTs of ~0.3 s, next to which the host's own few milliseconds per request
    # (not dilated either: 8 ms at D 0.75) stay small.
    line = {"rate_mbit": 500, "delay_ms": 15.0, "jitter_ms": 0.0, "queue_bytes": 4 * 500_000_000 // 8 * 30 // 1000}
    return scenario_with({"wan": {"forward": line, "reverse": line},
                          "datacenters": {"a": {"lan": {"rate_mbit": 400000}, "hosts": hosts},
                                          "b": {"lan": {"rate_mbit": 400000}, "hosts": b}}}, emulated=True)


def _specs() -> list[RequestSpec]:
    # A warm-up request (a real worker's first step pays torch's one-time costs; not measured),
    # then two prompt families (each family's later requests hit its prefix) far enough apart
    # that no request waits for another's KV on the line: each figure is one request's own.
    warm = RequestSpec("warm", synth_tokens("inv-warm", 120), 8, at=0.0)
    return [warm, *(RequestSpec(f"r{i}", synth_tokens(f"inv-{i % 2}", 160) + synth_tokens(f"inv-tail-{i}", 40 + 20 * i),
                                24 + 4 * i, at=0.4 + 0.4 * i) for i in range(6))]


def _latencies(compute: str, dilation: float) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """P50 and P90 of TTFT and TPOT (emulated seconds) of one PDD replay, and the verdict's reasons.
    Its workers' compute kept pace (overruns within the verdict's 1 %); a step that ended a few
    milliseconds late now and then (this VM's timers) is reported with the figures, not failed:
    what is compared here is the figures."""
    sc = _scenario(compute)
    plan = EmulationPlan.make(sc, 1, dilation, kv_bytes_per_token(ensure_default_model(), "float32"))
    specs = _specs()
    with Deployment(sc, parse_policy("pdd"), emulation=plan, dtype="float32") as dep:
        run = dep.run(TraceReplay([RequestSpec(s.rid, s.prompt, s.max_new, at=s.at * dilation) for s in specs],
                                  timeout_s=120 * dilation, show_progress=False))
    assert {w.compute for w in run.workers.values()} == {compute}
    assert all(w.device.overruns <= allowed(w.device.steps) for w in run.workers.values()), run.verdict.reasons
    df = request_rows(run.recs, run.router, specs, plan.scales)
    assert df.ok.all(), df.error.tolist()
    assert list(df.output_tokens) == [s.max_new for s in specs]
    df = df[df.rid != "warm"]
    return {k: (float(np.percentile(df[k], 50)), float(np.percentile(df[k], 90))) for k in STATS}, run.verdict.reasons


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    # D 10 for real compute: a first prefill of a prompt family (200-220 tokens, nothing cached)
    # takes 43-49 ms of this host's CPU against 39 ms modeled at D 6 (one or two of seven
    # steps overran); at D 8 (52 ms) a clean-clone suite once saw one such step overrun by
    # ~25 emulated ms, which moved the P50 TTFT of six requests by 13 %; 65 ms at D 10.
    return {"real D 10": _latencies("real", 10.0), "modeled D 2": _latencies("modeled", 2.0),
            # D 0.75, not 0.5: at 0.5 this VM's late wake-ups (5-16 % of the delay line's frames
            # over 1 ms late) moved a P50 TTFT by 12 % in one run of four
            "modeled D 0.75": _latencies("modeled", 0.75)}


def _same(a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], rel: float) -> list[str]:
    return [f"{k} P{q}: {x:.4f} vs {y:.4f}" for k in STATS for q, x, y in zip((50, 90), a[k], b[k], strict=True)
            if x != pytest.approx(y, rel=rel)]


@needs_root
def test_modeled_compute_reports_what_real_compute_reports(runs: dict[str, Any]) -> None:
    (real, _), (modeled, _) = runs["real D 10"], runs["modeled D 2"]
    assert _same(real, modeled, 0.10) == [], runs


@needs_root
def test_a_modeled_cluster_reports_the_same_faster_and_slower_than_real_time(runs: dict[str, Any]) -> None:
    (fast, _), (slow, _) = runs["modeled D 0.75"], runs["modeled D 2"]
    assert _same(fast, slow, 0.10) == [], runs
