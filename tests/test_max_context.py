"""``--max-context``: prompts longer than a context keep their last tokens, as a serving engine
truncates them; what that does to the prefix hit a trace plans, and where it is counted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from testbed.analysis.planned_hit import planned_hits
from testbed.traces import load_trace
from testbed.traces.stats import hit_rates
from testbed.traces.workload import Segment, TraceRequest, Workload, tail

from .conftest import ROOT, run_cli, run_cli_output


def test_a_truncated_prompt_keeps_exactly_its_last_token_ids() -> None:
    segs = [Segment("system", 40), Segment("turn-1", 30), Segment("lit", 5, (9, 8, 7, 6, 5))]
    whole = [t for s in segs for t in s.tokens()]
    for n in (75, 74, 45, 35, 10, 3):
        cut = tail(segs, n)
        assert sum(s.n for s in cut) == n and [t for s in cut for t in s.tokens()] == whole[-n:]
    assert tail(segs, 65)[0] == Segment("system", 30, None, 10) and tail(segs, 65)[0].stream == "system@10"


def _wl(*lengths: tuple[str, int]) -> Workload:
    """Requests whose prompts are the first n tokens of one shared stream each (a session's
    growing context), in order."""
    reqs = [TraceRequest(f"r{i}", [Segment(key, n)], 4, at=float(i)) for i, (key, n) in enumerate(lengths)]
    return Workload(Path("t.jsonl"), "test", reqs, token_scale=1, block_size=16)


def test_a_context_cap_breaks_the_prefix_a_growing_context_shares_and_is_counted() -> None:
    wl = _wl(("s", 64), ("s", 128), ("s", 192), ("s", 192))
    full = hit_rates(wl)
    assert full == pytest.approx({"r0": 0.0, "r1": 0.5, "r2": 128 / 192, "r3": 1.0})
    capped = wl.capped(96)
    assert [r.input_len for r in capped.requests] == [64, 96, 96, 96]
    assert capped.meta["max_context"] == {"tokens": 96, "truncated": 3, "of": 4, "dropped_tokens": 32 + 96 + 96}
    # Each truncated turn starts at another point of the stream: nothing shared with the turn
    # before, except the repeat truncated at the same point (r3 = r2).
    got = hit_rates(capped)
    assert got == pytest.approx({"r0": 0.0, "r1": 0.0, "r2": 0.0, "r3": 1.0})
    # The planned hit a run reports (segment by segment) says the same; token by token too.
    specs = capped.specs()
    sent = {s.rid: SimpleNamespace(sent=1.0 + i) for i, s in enumerate(specs)}
    assert planned_hits(sent, specs, 16, False) == pytest.approx(got)  # type: ignore[arg-type]
    as_ids = [dataclasses.replace(s, prompt=list(s.prompt)) for s in specs]
    assert planned_hits(sent, as_ids, 16, False) == pytest.approx(got)  # type: ignore[arg-type]
    assert wl.capped(None) is wl and wl.capped(1000).requests == wl.requests


def test_max_context_from_the_command_line_stats_and_a_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run_cli_output(["trace", "stats", str(ROOT / "traces/paper.jsonl"), "--token-scale", "16",
                                   "--max-context", "32768"], capsys)
    assert code == 0 and "max context 32768 tokens: 2186 of 2621 prompts truncated" in out
    code, err = run_cli(["trace", "stats", str(ROOT / "traces/paper.jsonl"), "--max-context", "0"], capsys)
    assert code == 2 and "--max-context: at least 1 token" in err
    code, out, err = run_cli_output(["run", "--engine", "sim", "--scenario", str(ROOT / "topologies/two-dc.yaml"),
                                     "--trace", str(ROOT / "traces/agentic-quick.jsonl"), "--token-scale", "16",
                                     "--limit", "8", "--policies", "same-dc", "--max-context", "8192",
                                     "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cap = summary["trace"]["meta"]["max_context"]
    assert cap["tokens"] == 8192 and 0 < cap["truncated"] <= cap["of"] == 117 and "of the trace's 117 prompts" in out
    assert max(len(s.prompt) for s in load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16, 8192).specs()) <= 512
