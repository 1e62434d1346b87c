"""The simulator against the emulation (root: namespaces, the delay line, real processes).

The link model against real TCP through the delay line on the default scenario's line, and
``testbed validate`` end to end on a small replay: both engines, every figure within its
tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.bench.links import TOLERANCE, run_links_bench
from testbed.deploy.deployment import network_session
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.model_files import ensure_model
from testbed.scenario import load_scenario
from workers.model_dir import kv_bytes_per_token

from .conftest import TOPOLOGIES, needs_root, run_cli_output

# Both compare timings measured on this host with a tolerance: run alone (make test's serial part).
pytestmark = [needs_root, pytest.mark.serial]


def test_the_link_model_times_transfers_as_the_delay_line_does() -> None:
    """One transfer on a new connection, two at once from two senders, a line that drops to
    half its rate mid-transfer, and one transfer streamed in eight pieces as a prefill's passes
    compute them: real TCP through the delay line and the link model agree
    within 10 %; two at once by the median of three runs on the line, as TCP shares it
    differently each time (the outage and 40-flow cases: ``testbed bench links``,
    docs/simulation.md)."""
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    plan = EmulationPlan.make(sc, 16, 1.0, kv_bytes_per_token(ensure_model(sc.model_dir()), sc.workers.dtype))
    wanted = {"one transfer, new connection", "two at once, two senders", "line at half rate from 1 s",
              "one streamed transfer, 8 passes"}
    with network_session(plan.wire_scenario(sc), "auto") as net:
        result = run_links_bench(net, chosen=lambda c: c.name in wanted, seconds=2.0)
    cases = {c["case"]: c for c in result["cases"]}
    assert set(cases) == wanted
    assert len(cases["two at once, two senders"]["line_runs"]) == 3
    outside = [c for c in cases.values() if abs(c["error"]) > TOLERANCE]
    assert not outside, outside


@pytest.mark.slow
def test_validate_replays_both_engines_and_every_figure_is_within_tolerance(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli_output(["validate", "--scenario", str(TOPOLOGIES / "two-dc-modeled.yaml"),
                                     "--trace", "traces/agentic-quick.jsonl", "--token-scale", "16", "--limit", "12",
                                     "--policies", "same-dc", "--dilation", "1", "--load", "2", "--out", str(tmp_path)],
                                    capsys)
    assert (tmp_path / "emulation" / "summary.json").exists() and (tmp_path / "sim" / "summary.json").exists()
    result = json.loads((tmp_path / "validation.json").read_text())
    judged = [f for f in result["figures"] if f["passed"] is not None]
    assert len(judged) >= 12 and code == 0, [f for f in judged if not f["passed"]]
    assert "figures within tolerance" in out
