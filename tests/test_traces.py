"""Trace formats, validation, slicing, statistics and the generator (no root needed)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import RequestHints
from testbed.errors import InputError
from testbed.traces import load_trace
from testbed.traces.generate import (
    OPEN_TTFT_S,
    GenConfig,
    draw_once,
    generate,
    generate_file,
    mooncake_lines,
    same_recipe,
    write_jsonl,
)
from testbed.traces.stats import hit_rates, trace_stats

from .conftest import ROOT

TRACELAB_HEADER = ("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms,"
                   "arrival_time\n")
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _write(tmp_path: Path, name: str, lines: list[object]) -> Path:
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def mc(ts: int, n_in: int, n_out: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# ------------------------------------------------------------------------- Mooncake
def test_mooncake_identical_hash_ids_give_identical_blocks(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.jsonl", [mc(0, 1200, 10, [7, 8, 9]), mc(500, 1100, 5, [7, 8, 4]), mc(900, 40, 3, [5])])
    wl = load_trace(p)
    assert wl.format == "mooncake" and wl.block_size == 512
    a, b, c = (r.prompt() for r in wl.requests)
    assert (len(a), len(b), len(c)) == (1200, 1100, 40)  # the last block is cut to input_length
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert [r.at for r in wl.requests] == [0.0, 0.5, 0.9]
    assert [r.output_len for r in wl.requests] == [10, 5, 3]


def test_mooncake_token_scale_divides_lengths_and_block(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.jsonl", [mc(0, 1200, 100, [7, 8, 9]), mc(1, 1100, 33, [7, 8, 4])])
    wl = load_trace(p, token_scale=16)
    assert wl.block_size == 32 and wl.token_scale == 16
    a, b = (r.prompt() for r in wl.requests)
    assert (len(a), len(b)) == (75, 69) and [r.output_len for r in wl.requests] == [7, 3]
    assert a[:64] == b[:64] and a[64:69] != b[64:69]


@pytest.mark.parametrize(("lines", "where"), [
    (['{"timestamp": 0, "input_length": 10'], "m.jsonl:1: (line): not valid JSON"),
    ([mc(0, 10, 1, [1]), {"timestamp": 5, "output_length": 3, "hash_ids": [1]}], "m.jsonl:2: input_length: missing"),
    ([{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}], "m.jsonl:1: input_length:"),
    ([mc(0, 10, -4, [1])], "m.jsonl:1: output_length: Input should be greater than or equal to 1"),
    ([mc(10, 10, 1, [1]), mc(5, 10, 1, [1])], "m.jsonl:2: timestamp: goes backwards"),
    ([mc(0, 10, 1, [1]), "", mc(1, 1500, 1, [1, 2])], "m.jsonl:3: hash_ids: 2 blocks of 512 tokens cannot cover"),
    ([mc(0, 100, 1, [1, 2])], "m.jsonl:1: hash_ids: 2 blocks for input_length 100"),
    ([mc(0, 10, 1, [])], "m.jsonl:1: hash_ids:"),
    # Non-finite, absurd, deep or endless: each a clear error at its line, never a traceback.
    (['{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [1]}'],
     "m.jsonl:1: (line): Infinity is not a number"),
    (['{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}'], "m.jsonl:1: (line): NaN"),
    ([mc(0, 10, 10**12, [1])], "m.jsonl:1: output_length: Input should be less than or equal to 1048576"),
    ([mc(1e300, 10, 1, [1])], "m.jsonl:1: timestamp: Input should be less than or equal to"),
    (['{"timestamp": 0, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"], "m.jsonl:1: (line): nested too deeply"),
    (['{"timestamp": 0, "input_length": 1' + "0" * 4300 + "}"], "m.jsonl:1: (line): a number too long to read"),
])  # fmt: skip
def test_mooncake_errors_name_file_line_field(tmp_path: Path, lines: list[object], where: str) -> None:
    p = _write(tmp_path, "m.jsonl", lines)
    with pytest.raises(InputError) as e:
        load_trace(p, "mooncake")
    assert where in str(e.value) and e.value.exit_code == 2


# ------------------------------------------------------------------------- Azure
def test_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    wl = load_trace(p)
    assert wl.format == "azure" and [r.input_len for r in wl.requests] == [374, 396]
    assert wl.requests[1].at == pytest.approx(4.314579, abs=1e-5)
    a, b = (r.prompt() for r in wl.requests)
    assert a[:10] != b[:10]  # no prefix information: unique prompts


@pytest.mark.parametrize(("body", "where"), [
    ("TIMESTAMP,ContextTokens\n1,2\n", "a.csv:1: header: missing column(s) GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,x,3\n", "a.csv:3: ContextTokens: expected an integer"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,-3\n", "a.csv:2: GeneratedTokens: must be in 1..1048576"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,2,3\n1,2,3\n", "a.csv:3: TIMESTAMP: goes backwards"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,2,3\n", "a.csv:2: TIMESTAMP: not a time"),
])  # fmt: skip
def test_azure_errors(tmp_path: Path, body: str, where: str) -> None:
    p = tmp_path / "a.csv"
    p.write_text(body)
    with pytest.raises(InputError, match=None) as e:
        load_trace(p)
    assert where in str(e.value)


# ------------------------------------------------------------------------- sessions
def _session(sid: str, start: float, turns: list[dict[str, object]], shared: int = 0) -> dict[str, object]:
    s: dict[str, object] = {"session": sid, "start_s": start, "turns": turns}
    if shared:
        s["shared_prefix"] = {"id": "sys", "tokens": shared}
    return s


def test_sessions_prompts_grow_by_previous_output_and_new_input(tmp_path: Path) -> None:
    p = _write(tmp_path, "s.jsonl", [
        {"format": "pdd-sessions", "version": 1, "seed": 3},
        _session("a", 0.0, [{"new_tokens": 100, "output_tokens": 20},
                            {"new_tokens": 30, "output_tokens": 5, "delay_s": 1.5},
                            {"new_tokens": 10, "output_tokens": 5, "at_s": 9.0, "short_output": True}], shared=64),
        _session("b", 2.0, [{"new_tokens": 50, "output_tokens": 4}], shared=64),
    ])  # fmt: skip
    wl = load_trace(p)
    assert wl.format == "sessions" and wl.meta == {"seed": 3}
    t0, t1, t2, b0 = wl.requests
    assert (t0.input_len, t1.input_len, t2.input_len) == (164, 164 + 20 + 30, 214 + 5 + 10)
    assert t1.prompt()[:164] == t0.prompt() and t2.prompt()[:214] == t1.prompt()
    assert b0.prompt()[:64] == t0.prompt()[:64] and b0.prompt()[64:] != t0.prompt()[64:114]
    assert (t1.after, t1.delay, t1.at) == ("a.0", 1.5, None)
    assert (t2.at, t2.after, t2.hints) == (9.0, None, RequestHints(short_output=True))
    specs = wl.specs(speed=2.0)
    assert specs[1].after == "a.0" and specs[1].delay == 0.75 and specs[2].at == 4.5


@pytest.mark.parametrize(("line", "where"), [
    (_session("a", 0, []), "s.jsonl:1: turns: List should have at least 1 item"),
    (_session("a", 0, [{"new_tokens": 5}]), "s.jsonl:1: turns.0.output_tokens: missing field"),
    (_session("a", 0, [{"new_tokens": 5, "output_tokens": 1, "delay_s": 1}]), "s.jsonl:1: turns.0.delay_s"),
    (_session("a", 0, [{"new_tokens": 5, "output_tokens": 1},
                       {"new_tokens": 5, "output_tokens": 1, "delay_s": -1}]), "s.jsonl:1: turns.1.delay_s"),
    (_session("a", 0, [{"new_tokens": 5, "output_tokens": 1, "bogus": 1}]), "s.jsonl:1: turns.0.bogus"),
])  # fmt: skip
def test_sessions_errors(tmp_path: Path, line: dict[str, object], where: str) -> None:
    p = _write(tmp_path, "s.jsonl", [line])
    with pytest.raises(InputError) as e:
        load_trace(p, "sessions")
    assert where in str(e.value)


def test_sessions_start_going_backwards(tmp_path: Path) -> None:
    turn = [{"new_tokens": 5, "output_tokens": 1}]
    p = _write(tmp_path, "s.jsonl", [_session("a", 5, turn), _session("b", 1, turn)])
    with pytest.raises(InputError, match=r"s.jsonl:2: start_s: goes backwards"):
        load_trace(p)


def test_select_limit_and_window_keep_sessions_consistent(tmp_path: Path) -> None:
    turns = [{"new_tokens": 5, "output_tokens": 1}, {"new_tokens": 5, "output_tokens": 1, "delay_s": 4.0}]
    p = _write(tmp_path, "s.jsonl", [_session("a", 0, turns), _session("b", 10, turns), _session("c", 20, turns)])
    wl = load_trace(p)
    assert [r.rid for r in wl.select(limit=3).requests] == ["a.0", "a.1", "b.0"]
    w = wl.select(window=(3.0, 21.0))
    # a.1 (est. 4 s) loses its predecessor: it is sent at its estimated time, shifted by 3 s.
    assert [(r.rid, r.at, r.after) for r in w.requests] == [
        ("a.1", 1.0, None), ("b.0", 7.0, None), ("b.1", None, "b.0"), ("c.0", 17.0, None)]


# ------------------------------------------------------------------------- statistics
def test_hit_rates_block_granular_in_arrival_order(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.jsonl", [
        mc(0, 1024, 1, [1, 2]),        # cold: 0
        mc(1, 1536, 1, [1, 2, 3]),     # 1024 / 1536
        mc(2, 1600, 1, [1, 2, 3, 4]),  # 1536 / 1600 = 96 %
        mc(3, 1000, 1, [1, 9]),        # 512 / 1000; a partial block never hits
        mc(4, 1000, 1, [1, 9]),        # same prompt: only its full block (512) hits
    ])  # fmt: skip
    rates = list(hit_rates(load_trace(p)).values())
    assert rates == pytest.approx([0, 1024 / 1536, 0.96, 0.512, 0.512])
    st = trace_stats(load_trace(p))
    assert st.hit_buckets["0-90%"] == pytest.approx(0.8) and st.hit_buckets["95-97%"] == pytest.approx(0.2)
    assert st.mean_hit_rate == pytest.approx(sum(rates) / 5)
    assert st.arrival_rate_rps == pytest.approx(5 / 0.004)


def test_an_answer_is_cached_after_its_request_when_the_system_keeps_answers(tmp_path: Path) -> None:
    p = _write(tmp_path, "s.jsonl", [
        _session("a", 0.0, [{"new_tokens": 1000, "output_tokens": 1100},
                            {"new_tokens": 30, "output_tokens": 5, "delay_s": 1.0}], shared=64),
    ])  # fmt: skip
    wl = load_trace(p)
    t0, t1 = wl.requests
    # The first turn carries the stand-in for its answer (what the next turn's prompt holds
    # after it); the last turn has no next turn to carry it to.
    assert t0.answer is not None and list(t0.answer.tokens()) == t1.prompt()[1064:2164] and t1.answer is None
    specs = wl.specs()
    assert specs[0].answer is not None and specs[1].answer is None and specs[0].hints.answer is None
    assert specs[0].sent_hints().answer == t1.prompt()[1064:2164] and specs[1].sent_hints().answer is None
    plain, cached = hit_rates(wl)["a.1"], hit_rates(wl, outputs_cached=True)["a.1"]
    assert plain == pytest.approx(1024 / 2194)  # two full blocks of the first prompt
    assert cached == pytest.approx(2048 / 2194)  # and two more of its answer
    assert trace_stats(wl).outputs_cached is False and trace_stats(wl, outputs_cached=True).outputs_cached


def test_the_reports_traffic_needs_answers_cached(tmp_path: Path) -> None:
    """~1K-token answers: 70-80 % of requests above 95 % hit only when each answer is cached
    by the next turn; with prompts alone cached the same recipe stays near half."""
    cfg = GenConfig(sessions=40, duration_s=60, seed=3, first_output_median=1000, output_median=1000,
                    calibrate_scale=16, outputs_cached=True)
    sessions, header = generate(cfg)
    assert header["outputs_cached"] is True
    write_jsonl(tmp_path / "g.jsonl", sessions, header)
    st = trace_stats(load_trace(tmp_path / "g.jsonl", token_scale=16))
    assert st.outputs_cached and 0.70 <= st.share_above_95 <= 0.80 and 0.85 <= st.mean_hit_rate <= 0.95
    plain = trace_stats(load_trace(tmp_path / "g.jsonl", token_scale=16), outputs_cached=False)
    assert plain.share_above_95 < 0.5
    without = dataclasses.replace(cfg, outputs_cached=False)
    write_jsonl(tmp_path / "n.jsonl", *generate(without))
    assert trace_stats(load_trace(tmp_path / "n.jsonl", token_scale=16)).share_above_95 < 0.6


def test_generator_follows_the_default_target_and_is_deterministic(tmp_path: Path) -> None:
    sessions, header = generate(GenConfig(sessions=40, duration_s=90, seed=5))
    write_jsonl(tmp_path / "g.jsonl", sessions, header)
    st = trace_stats(load_trace(tmp_path / "g.jsonl"))
    assert 0.85 <= st.mean_hit_rate <= 0.95
    assert 0.70 <= st.share_above_95 <= 0.80
    assert 0.02 <= st.low_hit_short_output_share <= 0.05
    again, header2 = generate(GenConfig(sessions=40, duration_s=90, seed=5))
    assert again == sessions and header2 == header
    assert generate(GenConfig(sessions=40, duration_s=90, seed=6))[0] != sessions
    # Exported as Mooncake records, the same prompts give the same hit distribution.
    wl = load_trace(tmp_path / "g.jsonl")
    write_jsonl(tmp_path / "m.jsonl", mooncake_lines(wl))
    st_m = trace_stats(load_trace(tmp_path / "m.jsonl"))
    assert st_m.requests == st.requests
    assert st_m.mean_hit_rate == pytest.approx(st.mean_hit_rate, abs=1e-9)


def test_open_loop_recipe_fixes_every_turn_in_time_and_arrives_at_the_asked_rate(tmp_path: Path) -> None:
    cfg = GenConfig(arrivals="open", rps=2.0, duration_s=240, seed=3, turns_max=8)
    sessions, header = generate(cfg)
    assert header["arrivals"] == "open" and header["rps"] == 2.0
    for s in sessions:
        ats = [t.get("at_s", 0.0) for t in s["turns"]]
        assert all("delay_s" not in t for t in s["turns"]) and ats == sorted(ats)
        for k in range(1, len(ats)):  # a turn waits at least the previous one's nominal answer
            assert ats[k] - ats[k - 1] >= OPEN_TTFT_S + cfg.open_tpot_s * s["turns"][k - 1]["output_tokens"] - 2e-3
    write_jsonl(tmp_path / "o.jsonl", sessions, header)
    wl = load_trace(tmp_path / "o.jsonl")
    assert all(r.after is None for r in wl.requests)  # no turn waits for an answer
    # Over an hour, requests of the sessions started in it arrive at the asked rate (one draw, no hit tuning).
    hour, _, _ = draw_once(dataclasses.replace(cfg, duration_s=3600), 0.8)
    assert sum(len(s["turns"]) for s in hour if s["start_s"] < 3600) == pytest.approx(2.0 * 3600, rel=0.08)
    # --load 2 doubles the rate: every send time halves.
    at1 = [r.at for r in wl.specs(1.0)]
    assert [r.at for r in wl.specs(2.0)] == pytest.approx([a / 2 for a in at1])
    # Closed loop with the same seed keeps the same prompts; only the timing differs.
    closed, _ = generate(GenConfig(arrivals="closed", rps=2.0, duration_s=240, seed=3, turns_max=8))
    strip = [[{k: v for k, v in t.items() if k not in ("at_s", "delay_s")} for t in s["turns"]] for s in sessions]
    assert strip == [[{k: v for k, v in t.items() if k not in ("at_s", "delay_s")} for t in s["turns"]] for s in closed]


def test_open_loop_recipe_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--arrivals"):
        generate_file(GenConfig(arrivals="sometimes"), tmp_path / "x.jsonl")
    with pytest.raises(InputError, match="--rps"):
        generate_file(GenConfig(rps=0.0), tmp_path / "x.jsonl")


def test_a_header_written_before_a_recipe_field_existed_is_the_same_recipe() -> None:
    _, header = generate(GenConfig(sessions=3, duration_s=5))
    older = {k: v for k, v in header.items() if k not in ("arrivals", "rps", "open_tpot_s")}
    assert same_recipe(older, {**header, "seed": 9}) and not same_recipe(older, {**header, "arrivals": "open"})


@pytest.mark.parametrize("name", ["agentic-default.jsonl", "agentic-quick.jsonl", "paper.jsonl", "prfaas.jsonl"])
def test_shipped_generated_traces_are_reproducible_from_their_header(name: str) -> None:
    path = ROOT / "traces" / name
    header = json.loads(path.read_text().splitlines()[0])
    fields = {k: header[k] for k in GenConfig().as_dict()}
    sessions, hdr = generate(GenConfig(**fields))
    expected = [json.dumps(hdr)] + [json.dumps(s, separators=(",", ":")) for s in sessions]
    assert path.read_text().splitlines() == expected


def test_request_list_prompt_ids_must_be_in_the_models_vocabulary(tmp_path: Path) -> None:
    ok = {"rid": "r0", "prompt": [5, 6, 7], "output_length": 2, "arrival_s": 0}
    bad = {"rid": "r1", "prompt": [5, 9000], "output_length": 2, "arrival_s": 0.1}
    assert load_trace(_write(tmp_path, "ok.jsonl", [ok]), "requests").requests[0].input_len == 3
    with pytest.raises(InputError, match=r"r.jsonl:2: .*token id 9000 is outside the default model's vocabulary"):
        load_trace(_write(tmp_path, "r.jsonl", [ok, bad]), "requests")


def test_a_bailian_trace_reads_as_conversation_trees_of_16_token_blocks(tmp_path: Path) -> None:
    wl = load_trace(ROOT / "traces/bailian-sample.jsonl")
    assert wl.format == "bailian" and wl.block_size == 16 and len(wl.requests) == 14
    by_rid = {r.rid: r for r in wl.requests}
    children = [r for r in wl.requests if r.after is not None]
    assert len(children) == 8 and len({r.session for r in wl.requests}) == 6
    for c in children:  # a turn carries its parent's prompt (its blocks) and is timed by the trace too
        parent = by_rid[c.after]
        assert c.prompt()[: parent.input_len] == parent.prompt() and c.at is not None and c.at > parent.at
    root = next(r for r in wl.requests if r.after is None)
    bad = [
        ({**json.loads((ROOT / "traces/bailian-sample.jsonl").read_text().splitlines()[0]), "parent_chat_id": 7},
         "parent_chat_id: '7' is no request before this line"),
        ({"chat_id": 1, "timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]},
         "hash_ids: 1 blocks of 16 tokens for input_length 100"),
    ]
    for line, says in bad:
        p = _write(tmp_path, "b.jsonl", [line])
        with pytest.raises(InputError, match=re.escape(f"b.jsonl:1: {says}")):
            load_trace(p)
    assert root.hints.tag in ("text", "search")


def test_a_bailian_child_waits_for_its_parents_answer_and_its_own_time() -> None:
    from testbed.load.trace_replay import TraceReplay
    from testbed.policies import parse_policy
    from testbed.scenario import load_scenario
    from testbed.sim.engine import SimDeployment, sim_plan

    sc = load_scenario(ROOT / "topologies/two-dc.yaml")
    wl = load_trace(ROOT / "traces/bailian-sample.jsonl", token_scale=16)
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values())
    t0 = min(r.sent for r in run.recs.values())
    for r in wl.requests:
        if r.after is not None:
            child, parent = run.recs[r.rid], run.recs[r.after]
            assert child.sent >= (parent.ended or 0) and child.sent - t0 >= r.at - 1e-6


def test_a_tracelab_trace_plans_each_rounds_cached_share_and_replays_closed_loop() -> None:
    from testbed.load.trace_replay import TraceReplay
    from testbed.policies import parse_policy
    from testbed.scenario import load_scenario
    from testbed.sim.engine import SimDeployment, sim_plan

    path = ROOT / "traces/tracelab-sample.csv"
    wl = load_trace(path, token_scale=16)
    rows = path.read_text().splitlines()[1:]
    assert wl.format == "tracelab" and len(wl.requests) == len(rows) and wl.meta["sessions"] == 5
    planned = hit_rates(wl, outputs_cached=True)  # each round's prefix: earlier prompts and answers
    for r, row in zip(wl.requests, rows, strict=True):
        prefix, n_in = (int(x) for x in row.split(",")[2:4])
        want = math.ceil(prefix / 16) // wl.block_size * wl.block_size / r.input_len
        assert planned[r.rid] == pytest.approx(want, abs=wl.block_size / r.input_len), (r.rid, row)
    sc = load_scenario(ROOT / "topologies/two-dc.yaml")
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values())
    for r in wl.requests:  # the next round: the answer, then the tool's time
        if r.after is not None:
            assert run.recs[r.rid].sent >= (run.recs[r.after].ended or 0) + r.delay - 1e-6
    waits = {r.rid: float(x.split(",")[5]) / 1000 for r, x in zip(wl.requests, rows, strict=True)}
    assert [r.delay for r in wl.requests if r.after] == pytest.approx([waits[r.after] for r in wl.requests if r.after])


@pytest.mark.parametrize(("name", "header", "row", "says"), [
    ("t.csv", TRACELAB_HEADER, "s,1,0,10,5,100,0", "round_idx: session 's': expected round 0, got 1"),
    ("t.csv", TRACELAB_HEADER, "s,0,20,10,5,100,0", "prefix_len: 20 is longer than input_len 10"),
    ("t.csv", TRACELAB_HEADER, "s,0,0,10,5,nan,0", "tool_wait_after_ms: expected seconds"),
    ("g.csv", BURSTGPT_HEADER, "1,ChatGPT,x,5,5,API log", "Request tokens: expected an integer, got 'x'"),
    ("g.csv", BURSTGPT_HEADER, "inf,ChatGPT,10,5,15,API log", "Timestamp: expected seconds"),
    ("g.csv", "Timestamp,Model,Request tokens\n", "1,ChatGPT,10", "header: missing column(s) Response tokens"),
])
def test_a_csv_traces_bad_field_is_named_with_its_line(tmp_path: Path, name: str, header: str, row: str,
                                                       says: str) -> None:
    p = tmp_path / name
    p.write_text(header + row + "\n")
    fmt = "tracelab" if header == TRACELAB_HEADER else "burstgpt"
    with pytest.raises(InputError, match=re.escape(f"{name}:{1 if 'header' in says else 2}: {says}")):
        load_trace(p, fmt)


def test_a_burstgpt_trace_reads_open_loop_and_leaves_out_what_failed_in_it() -> None:
    path = ROOT / "traces/burstgpt-sample.csv"
    wl = load_trace(path)  # detected from its header
    rows = [r.split(",") for r in path.read_text().splitlines()[1:]]
    failed = sum(1 for r in rows if r[3] == "0")
    assert wl.format == "burstgpt" and failed and wl.meta["failed_in_trace"] == failed
    assert len(wl.requests) == len(rows) - failed and all(r.after is None for r in wl.requests)
    assert [r.output_len for r in wl.requests] == [int(r[3]) for r in rows if r[3] != "0"]
    assert {r.hints.tag for r in wl.requests} <= {"ChatGPT", "GPT-4"}
    assert max(hit_rates(wl).values()) == 0  # nothing is shared in it


def test_a_copilot_agent_trace_plans_each_calls_cached_share_and_reads_gzip(tmp_path: Path) -> None:
    from testbed.load.trace_replay import TraceReplay
    from testbed.policies import parse_policy
    from testbed.scenario import load_scenario
    from testbed.sim.engine import SimDeployment, sim_plan

    path = ROOT / "traces/copilot-sample.jsonl"
    gz = tmp_path / "copilot.jsonl.gz"
    with gzip.open(gz, "wt") as f:  # as published
        f.write(path.read_text())
    wl = load_trace(gz, token_scale=16)
    calls = [c for line in path.read_text().splitlines() for t in json.loads(line)["turns"] for c in t["llm_calls"]]
    assert wl.format == "copilot-agent" and len(wl.requests) == len(calls) and wl.meta["sessions"] == 4
    assert wl.meta["cached_longer_than_previous"] == 0
    planned = hit_rates(wl)
    for r, c in zip(wl.requests, calls, strict=True):  # the trace's cached share, in whole blocks
        want = math.ceil(c["tokens"]["cached"] / 16) // wl.block_size * wl.block_size / r.input_len
        assert planned[r.rid] == pytest.approx(want, abs=1e-9), (r.rid, c["tokens"])
    sc = load_scenario(ROOT / "topologies/two-dc.yaml")
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values())
    for r in wl.requests:  # the next call: the answer, then the recorded gap
        if r.after is not None:
            assert r.delay > 0 and run.recs[r.rid].sent >= (run.recs[r.after].ended or 0) + r.delay - 1e-6


@pytest.mark.parametrize(("edit", "says"), [
    (lambda c: c.update(tokens={"prompt": 10, "completion": 5, "cached": 11}),
     "turns: call 1: tokens.cached: 11 is more than its prompt (10)"),
    (lambda c: c.update(timestamp="2020-01-01T00:00:00Z"), "turns: call 1: timestamp: before the previous call's"),
    (lambda c: c.update(timestamp="yesterday"), "llm_calls.1.timestamp.int: Input should be a valid integer"),
])
def test_a_copilot_calls_bad_field_is_named_with_its_line(tmp_path: Path, edit: Any, says: str) -> None:
    session = json.loads((ROOT / "traces/copilot-sample.jsonl").read_text().splitlines()[0])
    edit(session["turns"][0]["llm_calls"][1])
    p = _write(tmp_path, "c.jsonl", [session])
    with pytest.raises(InputError, match=re.escape("c.jsonl:1: ") + ".*" + re.escape(says)):
        load_trace(p)
