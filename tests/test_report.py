"""Reports from saved runs (no network): summaries of fixed records, the report's figures
beside ours, and a report rebuilt from the saved files byte for byte."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from testbed.analysis import report
from testbed.analysis.confidence import mean_ci, t975
from testbed.analysis.cost import HardwareCost, cost_per_million_tokens, egress_price, hardware_cost
from testbed.analysis.metrics import Slo, summarize
from testbed.analysis.results import PolicySummary, RunSummary, TraceInfo, load_run
from testbed.analysis.tables import markdown_table, table_head
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fidelity import Verdict
from testbed.errors import InputError
from testbed.policies.base import PolicyReport
from testbed.policies.classic import CrossDc, SameDc
from testbed.policies.pdd import Pdd
from testbed.scenario import load_scenario

from .conftest import ROOT, TOPOLOGIES, run_cli, scenario_with


def _rows(ttfts: list[float], wan_s: float | None = None, relay: bool = False) -> pd.DataFrame:
    n = len(ttfts)
    hit = [1000 * (i % 10) / 10 for i in range(n)]  # 0 % .. 90 % prefix hit
    return pd.DataFrame({
        "rid": [f"r{i}" for i in range(n)], "ok": True, "error": None,
        "pipeline": "P-RLD-MD" if relay else "P-D(a)",
        "prefill_worker": "prefill", "decode_worker": "decode-b" if relay else "decode-a",
        "relay": "relay" if relay else None,
        "prompt_tokens": 1000, "output_tokens": 20, "output_tokens_emulated": 80,
        "prefill_hit_tokens": hit, "sent_offset_s": np.arange(n, dtype=float),
        "ttft_s": ttfts, "tpot_s": 0.05, "e2e_s": [t + 1.0 for t in ttfts],
        "kv_bytes": 4096, "wan_kv_bytes": 4096 if wan_s else 0, "wan_kv_cancelled_bytes": 0,
        "wan_kv_in_flight_bytes": 0,
        "wan_cut_off": False,
        "wan_transfer_s": [wan_s * (1 + i) if wan_s else np.nan for i in range(n)],
        "wan_start_s": [float(i) if wan_s else np.nan for i in range(n)],
        "wan_end_s": [i + wan_s * (1 + i) if wan_s else np.nan for i in range(n)],
        "eager_tokens": 8 if relay else 0, "handoffs": 1 if relay else 0,
        "md_kv_to_handoff_s": 0.1 if relay else np.nan, "handoff_mismatches": 0,
        "handoff_at_s": [i + t + 0.5 if relay else np.nan for i, t in enumerate(ttfts)], "attempts": 1,
    })  # fmt: skip


def _policy(df: pd.DataFrame) -> PolicySummary:
    return PolicySummary(**dict(summarize(df, [], Slo(ttft_s=3.0))), policy_stats=PolicyReport(), fidelity=Verdict())


def _saved_run(out: Path, shift: float = 0.0, only: tuple[str, ...] | None = None, render: bool = False) -> RunSummary:
    """A run's saved files (rows and summary), its report and plots rendered when asked."""
    frames = {
        "same-dc": _rows([shift + 1.0 + 0.1 * i for i in range(20)]),
        "cross-dc": _rows([shift + 2.0 + 0.5 * i for i in range(20)], wan_s=0.5),
        "pdd": _rows([shift + 1.5 + 0.1 * i for i in range(20)], wan_s=0.5, relay=True),
    }
    frames = {k: v for k, v in frames.items() if only is None or k in only}
    sc = scenario_with(emulated=True)
    summary = RunSummary(
        trace=TraceInfo(trace="traces/x.jsonl", format="sessions", requests=20, token_scale=4, block_size=4),
        speed=1.0, limit=None, window=None, emulation=EmulationPlan.make(sc, 4, 2.0, 4096).summary(sc),
        scenario=sc, policies={name: _policy(df) for name, df in frames.items()}, workers={},
    )  # fmt: skip
    (report.save if render else report.save_data)(out, frames, summary)
    return summary


def test_summary_of_fixed_records() -> None:
    s = _policy(_rows([1.0 + 0.1 * i for i in range(20)]))
    assert s.ttft_p50_s == pytest.approx(1.95) and s.ttft_mean_s == pytest.approx(1.95)
    assert s.ttft_p99_s == pytest.approx(1.0 + 0.1 * 18.81)  # numpy's linear interpolation
    assert s.slo_met == 20  # every TTFT <= 2.9 s < 3 s and TPOT 0.05 <= 0.25
    c = _policy(_rows([2.0 + 0.5 * i for i in range(20)], wan_s=0.5))
    assert c.slo_met == 3  # 2.0, 2.5 and 3.0 s: a TTFT at the objective meets it
    assert (c.wan_transfers, c.wan_transfer_min_s, c.wan_transfer_max_s) == (20, 0.5, 10.0)
    assert c.wan_kv_bytes == 20 * 4096
    p = _policy(_rows([1.5] * 20, wan_s=0.5, relay=True))
    assert p.rld_share == pytest.approx(0.1) and p.relayed == 20 and p.requests_by_worker["relay"] == 20


def test_paper_comparison_puts_our_figures_beside_the_report(tmp_path: Path) -> None:
    table = report.paper_comparison(_saved_run(tmp_path))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in table.splitlines()[2:]}
    assert rows["cross-dc minus same-dc TTFT P50"] == ["+2.5 s", "+4.80 s |"]  # 6.75 - 1.95
    assert rows["same-dc TTFT P50"] == ["4.2 s", "1.95 s |"]
    assert rows["cross-dc WAN KV transfer time (min-max)"][1].startswith("0.50-10.00 s")
    assert rows["PDD TTFT P50 vs cross-dc"][1] == f"{100 * (2.45 - 6.75) / 6.75:+.1f} % |"
    assert rows["RLD share of output tokens (PDD)"] == ["6.2 %", "10.0 % |"]
    brief = report.paper_comparison(_saved_run(tmp_path / "again"), headline=True)
    names = [line.split(" | ")[0].strip("| ") for line in brief.splitlines()[2:]]
    assert names[:6] == list(rows)[:6] and len(names) == 9
    assert {"PDD TTFT P99 vs cross-dc", "PDD TTFT mean vs same-dc"} <= set(names)
    assert "PDD TTFT P50 vs cross-dc" not in names


def test_report_is_rebuilt_from_the_saved_files_alone(tmp_path: Path) -> None:
    _saved_run(tmp_path, render=True)
    made = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {"report.md", "latency.png", "ttft_by_hit.png", "timeline.png", "summary.json"} <= set(made)
    text = made["report.md"].decode()
    assert "| cross-dc TTFT P99 | 29.7 s |" in text and "fidelity pdd: passed" in text
    for name in ("report.md", "latency.png", "ttft_by_hit.png", "timeline.png"):
        (tmp_path / name).unlink()
    res = subprocess.run([sys.executable, "-m", "testbed", "report", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "report.md").read_bytes() == made["report.md"]
    assert all((tmp_path / n).stat().st_size > 0 for n in ("latency.png", "ttft_by_hit.png", "timeline.png"))
    summary, df = load_run(tmp_path)
    assert summary.policies["cross-dc"].ttft_p50_s == pytest.approx(6.75) and len(df) == 60


def test_runs_of_the_same_trace_and_emulation_merge_into_one_folder(tmp_path: Path) -> None:
    _saved_run(tmp_path / "all", render=True)
    _saved_run(tmp_path / "base", only=("same-dc", "cross-dc"))
    _saved_run(tmp_path / "pdd", only=("pdd",))
    report.merge_runs([tmp_path / "base", tmp_path / "pdd"], tmp_path / "merged")
    assert (tmp_path / "merged" / "report.md").read_text() == (tmp_path / "all" / "report.md").read_text()
    merged, df = load_run(tmp_path / "merged")
    assert list(merged.policies) == ["same-dc", "cross-dc", "pdd"] and len(df) == 60
    _saved_run(tmp_path / "other", shift=1.0, only=("pdd",))
    other = load_run(tmp_path / "other")[0].model_copy(update={"speed": 2.0})
    (tmp_path / "other" / "summary.json").write_text(other.model_dump_json())
    with pytest.raises(InputError, match="not the same trace, load and emulation"):
        report.merge_runs([tmp_path / "base", tmp_path / "other"], tmp_path / "bad")


def test_report_of_a_folder_that_is_no_run_is_a_clear_error(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and f"{tmp_path}: not a run directory (summary.json missing)" in err
    (tmp_path / "summary.json").write_text('{"trace": 1}')
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "requests.parquet")
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and "summary.json: not a summary this version can read" in err


def test_hardware_cost_of_the_reports_deployment() -> None:
    sc = load_scenario(TOPOLOGIES / "paper.yaml")
    same, pdd = hardware_cost(sc, SameDc), hardware_cost(sc, Pdd)
    assert same is not None and pdd is not None
    assert same.devices == {"h100": 88} and not same.wan_line and same.total == 88.0
    assert pdd.devices == {"h100": 43, "h20": 32} and pdd.wan_line
    assert hardware_cost(sc, CrossDc).devices == {"h100": 40, "h20": 32}  # type: ignore[union-attr]
    # The report's table: GPU-B 20-30 % dearer, total 3.5-7.1 % lower.
    for price, lower in ((1.2, 7.1), (1.3, 3.5)):
        c = hardware_cost(sc.model_copy(update={"costs": sc.costs.model_copy(update={"devices": {  # type: ignore[union-attr]
            "h100": 1.0, "h20": price}})}), Pdd)
        assert c is not None and 100 * (1 - c.total / 88) == pytest.approx(lower, abs=0.05)
    # 83.35 per hour for 2 hours over 1M tokens.
    assert cost_per_million_tokens(pdd, 7200.0, 1_000_000) == pytest.approx(2 * 83.35)
    assert cost_per_million_tokens(pdd, None, 10) is None
    # Egress: 500 GB over the line at the scenario's price per GB, added to the run's hardware.
    egress = egress_price(sc, 500.0)
    assert egress == pytest.approx(500 * sc.costs.wan_egress_per_gb) and egress > 0  # type: ignore[union-attr]
    assert cost_per_million_tokens(pdd, 7200.0, 1_000_000, egress) == pytest.approx(2 * 83.35 + egress)
    assert egress_price(sc.model_copy(update={"costs": None}), 500.0) is None


@pytest.mark.parametrize(("change", "complaint"), [
    ({"devices": {"h100": 1.0}}, "costs.devices has no price for device profile 'h20'"),
    ({"devices": {"h100": 1.0, "h20": 1.2, "tpu": 2.0}}, "costs.devices names unknown device profile 'tpu'"),
    ({"devices": {"h100": -1.0, "h20": 1.2}}, "price of 'h100' must be >= 0"),
])
def test_bad_cost_tables_are_rejected(tmp_path: Path, change: dict[str, object], complaint: str) -> None:
    raw = yaml.safe_load((TOPOLOGIES / "paper.yaml").read_text())
    raw["costs"].update(change)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(InputError, match=re.escape(complaint)):
        load_scenario(path)


def test_cost_table_in_the_report(tmp_path: Path) -> None:
    summary = _saved_run(tmp_path)
    assert report.cost_table(summary) is None  # the scenario states no prices
    def cost(name: str) -> HardwareCost:
        line = name != "same-dc"
        return HardwareCost(unit="GPU-A hours", devices={"h100": 2}, wan_line=line, total=2.0 + 0.5 * line)

    priced = summary.model_copy(update={"policies": {
        name: s.model_copy(update={"cost": cost(name), "cost_per_mtok": 1.5, "wan_gb": 12.5, "egress": 0.1,
                                   "cost_per_mtok_with_egress": 1.625}) for name, s in summary.policies.items()}})
    table = report.cost_table(priced)
    assert table is not None and "| pdd | 2 x h100 + line | 2.50 | +25.0 % | 1.500 | 12.500 | 0.1000 | 1.625 |" \
        in table
    assert "## Hardware cost" in report.report_markdown(priced)


def test_mean_and_confidence_interval() -> None:
    ci = mean_ci([1.95, 2.05, 2.15])
    assert ci is not None and ci.n == 3 and ci.mean == pytest.approx(2.05)
    assert ci.half == pytest.approx(4.303 * 0.1 / 3**0.5)  # t(0.975, 2) x s / sqrt(n)
    assert ci.format(1000) == "2050 ± 248"
    one = mean_ci([3.0])
    assert one is not None and one.half is None and one.format() == "3"
    assert mean_ci([]) is None and mean_ci([float("nan")]) is None
    assert t975(45) == 2.021 and t975(500) == 1.960  # between rows: the wider interval


def test_repetitions_table_over_saved_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [tmp_path / f"run{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        _saved_run(d, shift=0.1 * i)
    code, err = run_cli(["report", *map(str, dirs), "--out", str(tmp_path / "rep")], capsys)
    assert code == 0, err
    text = (tmp_path / "rep" / "repetitions.md").read_text()
    assert "(n = 3)" in text
    same = next(line for line in text.splitlines() if line.startswith("| same-dc |"))
    assert same.split(" | ")[1] == "2050 ± 248"  # TTFT P50 1.95, 2.05, 2.15 s
    assert same.rstrip(" |").endswith("3/3")
    assert "| cross-dc minus same-dc TTFT P50 | +2.5 s | +4.80 ± 0.00 s (n=3) |" in text
    # A run of another setup is refused, naming it.
    other = tmp_path / "other"
    _saved_run(other)
    s, _ = load_run(other)
    (other / "summary.json").write_text(s.model_copy(update={"speed": 2.0, "policies": {
        "same-dc": s.policies["same-dc"]}}).model_dump_json())
    code, err = run_cli(["report", str(dirs[0]), str(other), "--out", str(tmp_path / "rep2")], capsys)
    assert code == 2 and f"{other}: not a repetition of {dirs[0]}: policies" in err


def test_markdown_tables_have_one_shape() -> None:
    assert markdown_table(["policy", "TTFT"], [["pdd", 1.5]], "lr") == ["| policy | TTFT |", "|---|---:|",
                                                                        "| pdd | 1.5 |"]
    assert table_head(["a", "b", "c"], "r") == ["| a | b | c |", "|---:|---|---|"]
    with pytest.raises(ValueError, match="does not fit 2 columns"):
        table_head(["a", "b"], "lrr")


def test_planned_hit_is_what_an_unbounded_cache_of_earlier_prompts_holds_and_sits_beside_the_got() -> None:
    from testbed.analysis.planned_hit import planned_hits
    from testbed.deploy.run_record import ClientRecord
    from testbed.traces.workload import RequestSpec, synth_tokens

    head, tail = synth_tokens("head", 64), synth_tokens("tail", 40)
    specs = [RequestSpec("a", head, 4), RequestSpec("b", head + tail, 4, answer=synth_tokens("ans", 30)),
             RequestSpec("c", head + tail + synth_tokens("ans", 30) + synth_tokens("more", 10), 4),
             RequestSpec("d", synth_tokens("other", 50), 4)]
    recs = {s.rid: ClientRecord(s.rid, len(s.prompt), 4, sent=float(i + 1)) for i, s in enumerate(specs)}
    plain = planned_hits(recs, specs, 16, outputs_cached=False)
    assert plain == {"a": 0.0, "b": pytest.approx(64 / 104), "c": pytest.approx(96 / 144), "d": 0.0}
    cached = planned_hits(recs, specs, 16, outputs_cached=True)  # b's answer too: c finds 128 of its 144
    assert cached["c"] == pytest.approx(128 / 144) and cached["b"] == plain["b"]
    recs["a"].sent = 5.0  # sent last: nothing before it, and b and c no longer find its blocks in the cache
    assert planned_hits(recs, specs, 16, outputs_cached=False)["b"] == 0.0
    df = _rows([1.0] * 10).assign(planned_hit=1.0, prefill_hit=lambda d: d.prefill_hit_tokens / d.prompt_tokens,
                                  decode_hit=[0.2] * 5 + [np.nan] * 5)
    s = _policy(df)
    assert (s.hit_planned_mean, s.hit_planned_above95) == (1.0, 1.0)
    assert s.hit_got_mean == pytest.approx(0.45) and s.hit_got_above95 == 0.0
    assert s.hit_decode_mean == pytest.approx(0.2)  # over the requests whose main decoder got KV
    section = report.hit_section(RunSummary.model_construct(policies={"pdd": s}))
    assert section[0] == "## Prefix hit: planned and got"
    assert "| pdd | 100.0 % | 100.0 % | 45.0 % | 0.0 % | 20.0 % |" in section


@pytest.mark.parametrize("outputs_cached", [False, True])
def test_planned_hit_from_recipes_equals_the_token_by_token_one(outputs_cached: bool) -> None:
    """A trace's prompts are compared segment by segment (memory by segments: an hour at token
    scale 1 is 400 M tokens); the same prompts as token lists, block by block, give the same."""
    import dataclasses

    from testbed.analysis.planned_hit import planned_hits
    from testbed.deploy.run_record import ClientRecord
    from testbed.traces import load_trace

    specs = load_trace(ROOT / "traces/paper.jsonl", "auto", 16).select(300).specs(1.0)
    recs = {s.rid: ClientRecord(s.rid, len(s.prompt), s.max_new, sent=float(i + 1)) for i, s in enumerate(specs)}
    lists = [dataclasses.replace(s, prompt=list(s.prompt), answer=None if s.answer is None else list(s.answer))
             for s in specs]
    recipes = planned_hits(recs, specs, 16, outputs_cached)
    assert recipes == planned_hits(recs, lists, 16, outputs_cached)
    assert 0.5 < sum(recipes.values()) / len(recipes) < 1.0  # the trace shares most of its prompts
