"""Dynamo's agentic_mooncake traces: Mooncake rows with the calls an agent waits for. Read and
validated line by line (file:line:field); a call that waits for several is sent once all have
completed, then its delay and tool time, in the simulator as in any replay; a slice keeps the
waits it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces import load_trace

from .conftest import ROOT, TOPOLOGIES

SAMPLE = ROOT / "traces/agentic-mooncake-sample.jsonl"


def _rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def test_the_sample_reads_with_its_waits() -> None:
    wl = load_trace(SAMPLE)  # detected by session_id beside hash_ids
    assert wl.format == "agentic-mooncake" and len(wl.requests) == 16 and wl.block_size == 512
    by_line = {r.line: r for r in wl.requests}
    rows = _rows()
    ids = {row["request_id"]: i + 1 for i, row in enumerate(rows)}
    fan_in = next(i + 1 for i, row in enumerate(rows) if len(row.get("wait_for", [])) == 2)
    r = by_line[fan_in]
    waited = [by_line[ids[w]].rid for w in rows[fan_in - 1]["wait_for"]]
    assert [r.after, *r.also_after] == waited and r.at is None
    assert r.delay == pytest.approx((rows[fan_in - 1]["delay"] + rows[fan_in - 1]["tool_wait_ms"]) / 1000)
    assert sum(x.at is not None for x in wl.requests) == 3  # one open call per agent
    assert any(x.hints.tag == "prefix-reset" for x in wl.requests)
    # A slice that cuts one of the two calls it waits for keeps the other.
    cut = {x.rid: x for x in wl.select(limit=15).requests}
    kept = [x for x in cut.values() if x.line == fan_in]
    assert not kept or all(p in cut for p in (kept[0].after, *kept[0].also_after))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda rows: rows[1].update(wait_for=["nobody"]), ":2: wait_for[0]: 'nobody' is not the request_id of an earlier"),
    (lambda rows: rows[1].update(request_id=rows[0]["request_id"]), ":2: request_id: .* is not unique"),
    (lambda rows: rows[0].update(branches=["agent-0-3"]), ":1: branches[0]: 'agent-0-3' is not a row that waits"),
    (lambda rows: rows[0].update(hash_ids=[1]), ":1: hash_ids: 1 blocks of 512 tokens"),
    (lambda rows: rows[2].update(tool_wait_ms=-1), ":3: tool_wait_ms"),
    (lambda rows: rows[2].update(prefix_reset="yes"), ":3: prefix_reset"),
])  # fmt: skip
def test_a_bad_row_is_an_error_naming_file_line_and_field(tmp_path: Path, edit: object, says: str) -> None:
    rows = _rows()
    edit(rows)  # type: ignore[operator]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"bad\.jsonl" + says.replace("[", r"\[").replace("]", r"\]")):
        load_trace(bad, "agentic-mooncake")


def test_a_call_waiting_for_several_is_sent_after_all_of_them() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(SAMPLE, "auto", 16)
    with SimDeployment(sc, parse_policy("pdd"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values()), {k: r.error for k, r in run.recs.items() if not r.ok}
    for r in wl.requests:
        waits = [p for p in (r.after, *r.also_after) if p is not None]
        if waits:
            last = max(run.recs[p].ended or 0.0 for p in waits)
            assert run.recs[r.rid].sent >= last + r.delay - 1e-6, r.rid
    assert sum(len(r.also_after) for r in wl.requests) == 3  # each agent's fan-in waited for two
