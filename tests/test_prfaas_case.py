"""Prefill-as-a-Service's case study (``make reproduce-prfaas``) in miniature: its three
deployments swept in the simulator, composed into the paper's figures by ``testbed report``;
the naive baseline offloads every prefill (no prefill instance where requests enter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.experiments.prfaas_case import CASE_FILE, FIGURES

from .conftest import TOPOLOGIES, run_cli_output

DESIGNS = {"prfaas": ("prfaas.yaml", "prefill-offload"), "homogeneous": ("prfaas-homogeneous.yaml", "same-dc"),
           "naive": ("prfaas-naive.yaml", "prefill-offload")}


def test_the_case_study_composes_three_sweeps_into_the_papers_figures(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, (scenario, policy) in DESIGNS.items():
        code, _, err = run_cli_output(["sweep", "--engine", "sim", "--scenario", str(TOPOLOGIES / scenario),
                                       "--trace", "traces/prfaas.jsonl", "--token-scale", "16", "--limit", "30",
                                       "--load", "0.2:0.2:0.1", "--slo-ttft", "30", "--slo-tpot", "0.1",
                                       "--policies", policy, "--out", str(tmp_path / name)], capsys)
        assert code == 0, err[-2000:]
    naive = json.loads((tmp_path / "naive/load-0.2/summary.json").read_text())["policies"]["prefill-offload"]
    assert set(naive["pipelines"]) == {"P(b)-D(a)"}
    assert naive["policy_stats"]["counts"] == {"offloaded (no prefill home)": 30}
    mine = json.loads((tmp_path / "prfaas/load-0.2/summary.json").read_text())["policies"]["prefill-offload"]
    assert {"P(b)-D(a)", "P-D(a)"} <= set(mine["pipelines"])  # only the long uncached prefills go away
    code, _, err = run_cli_output(["report", str(tmp_path)], capsys)
    assert code == 0, err[-2000:]
    table = (tmp_path / CASE_FILE).read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "paper" not in line]
    for f in FIGURES:
        row = next(r for r in rows if r.startswith(f"| {f.name} |"))
        assert row.split("|")[3].strip() not in ("", "-"), row  # measured in this draw
        assert row.split("|")[4].strip() in ("yes", "**no**"), row
    assert "| prfaas (prefill-offload) |" in table and "| 128.0 |" in table  # 64 H20 + 32 H200 at 2 H20
