"""SemiAnalysis cc-traces: agent sessions of calls with 64-token hash blocks, read as published
(a session a line, hash ids local to their trace), replayed open loop in the simulator."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from testbed.errors import InputError
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces import load_trace
from testbed.traces.formats import detect_format
from testbed.traces.stats import hit_rates

from .conftest import ROOT

SAMPLE = ROOT / "traces/cc-traces-sample.jsonl"


def _sessions() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def test_a_cc_trace_reads_each_sessions_calls_with_their_64_token_blocks() -> None:
    assert detect_format(SAMPLE) == "cc-traces"
    wl = load_trace(SAMPLE)
    calls = [(s, k, c) for s, tr in enumerate(_sessions(), 1) for k, c in enumerate(tr["requests"])]
    assert wl.format == "cc-traces" and wl.block_size == 64 and len(wl.requests) == len(calls)
    t0 = min(c["t"] for _, _, c in calls)
    by_rid = {r.rid: r for r in wl.requests}
    for s, k, c in calls:
        r = by_rid[f"c{s:05d}.{k:05d}"]
        assert r.input_len == c["in"] and r.output_len == c["out"] and r.at == pytest.approx(c["t"] - t0)
        assert r.session == f"cc{s}" and r.hints.tag == c["model"]
    # A call shares the blocks its session's earlier calls sent (whole 64-token blocks); the two
    # sessions use the same ids, local to each: they share nothing.
    planned = hit_rates(wl)
    for s, k, c in calls:
        prev = _sessions()[s - 1]["requests"][k - 1] if k else {"hash_ids": [], "in": 0}
        same = next((i for i, (a, b) in enumerate(zip(c["hash_ids"], prev["hash_ids"], strict=False)) if a != b),
                    min(len(prev["hash_ids"]), len(c["hash_ids"])))
        whole = min(same, prev["in"] // 64, c["in"] // 64)  # blocks the previous call held whole
        assert planned[f"c{s:05d}.{k:05d}"] == pytest.approx(whole * 64 / c["in"]), (s, k)
    # At token scale 16 the blocks are 4 tokens; the sample replays in the simulator.
    scaled = load_trace(SAMPLE, token_scale=16)
    assert scaled.block_size == 4 and scaled.requests[0].input_len == math.ceil(calls[0][2]["in"] / 16)
    sc = load_scenario(ROOT / "topologies/two-dc.yaml")
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(scaled.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values())


@pytest.mark.parametrize(("edit", "says"), [
    (lambda tr: tr["requests"][1].update({"in": 10_000}), "blocks of 64 tokens for in 10000"),
    (lambda tr: tr["requests"][2].update(t=0.0), "requests[2].t: goes backwards"),
    (lambda tr: tr["requests"][0].update(out=0), "requests.0.out: Input should be greater than or equal to 1"),
    (lambda tr: tr.update(hash_id_scope="galactic"), "hash_id_scope: Input should be 'local' or 'global'"),
])
def test_a_cc_calls_bad_field_is_named_with_its_line(tmp_path: Path, edit: Any, says: str) -> None:
    trs = _sessions()
    edit(trs[1])
    p = tmp_path / "cc.jsonl"
    p.write_text("\n".join(json.dumps(tr) for tr in trs) + "\n")
    with pytest.raises(InputError, match=re.escape("cc.jsonl:2: ") + ".*" + re.escape(says)):
        load_trace(p)
