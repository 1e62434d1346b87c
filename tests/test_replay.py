"""Trace replay end to end (root): closed-loop sessions, saved results, strict validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.worker_config import WorkerFaults
from testbed.analysis.results import load_run
from testbed.deploy.deployment import Deployment
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.traces import load_trace

from .conftest import ROOT, host_state, left_behind, needs_root, run_cli, scenario_with

pytestmark = needs_root


def _testbed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def _sessions(path: Path, n: int, turns: int, out_tokens: int = 6, delay: float = 0.4) -> Path:
    lines = []
    for s in range(n):
        ts = [{"new_tokens": 40 + 10 * s, "output_tokens": out_tokens}]
        ts += [{"new_tokens": 12, "output_tokens": out_tokens, "delay_s": delay} for _ in range(turns - 1)]
        lines.append({"session": f"t{s}", "start_s": 0.2 * s, "shared_prefix": {"id": "sys", "tokens": 96},
                      "turns": ts})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_bad_trace_exits_2_naming_line_and_field_and_starts_nothing(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 5, "input_length": 2000, "output_length": 3, "hash_ids": [1, 2]}\n')
    before = host_state()
    res = _testbed("run", "--trace", str(bad), "--policies", "same-dc")
    assert res.returncode == 2, res.stderr
    assert f"{bad}:2: hash_ids:" in res.stderr
    assert not left_behind(before)
    # The same checks of the policy grammar, in this process (the exit path is the one above).
    trace = str(ROOT / "traces" / "agentic-default.jsonl")
    code, err = run_cli(["run", "--trace", trace, "--policies", "nope"], capsys)
    # (and any plugin loaded)
    assert code == 2 and "--policies: unknown policy 'nope' (known: colocated, cross-dc, " in err
    assert all(name in err.split("(known: ")[1] for name in ("pdd", "prefill-offload", "same-dc"))
    for spelling, says in [("same-dc,pdd:handoff=sideways", "option handoff='sideways': Input should be"),
                           ("pdd:threshold=64,lodd=3", "unknown option 'lodd' (options: handoff, threshold"),
                           ("pdd:relay_s=-1", "option relay_s='-1': Input should be greater than or equal to 0")]:
        code, err = run_cli(["run", "--trace", trace, "--policies", spelling], capsys)
        assert code == 2 and f"error: --policies: pdd: {says}" in err, err


@pytest.mark.slow
def test_closed_loop_sessions_replay_and_results_are_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _sessions(tmp_path / "s.jsonl", n=3, turns=3)
    out = tmp_path / "out"
    # About replay and saved results, not fidelity (tests/test_fidelity.py): any verdict is
    # fine, and a fixed dilation spares the calibration (its own tests are in test_fidelity).
    res = _testbed("run", "--trace", str(trace), "--policies", "same-dc", "--token-scale", "2", "--out", str(out),
                   "--allow-infidelity", "--dilation", "3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "same-dc" in res.stdout and "TTFT p50 ms" in res.stdout
    made = ("requests.csv", "requests.parquet", "summary.json", "report.md", "latency.png", "ttft_by_hit.png",
            "timeline.png")
    for name in made:
        assert (out / name).stat().st_size > 0, name
    summary, rows = load_run(out)
    df = rows.set_index("rid")
    assert len(df) == 9 and df.ok.all()
    assert summary.trace.token_scale == 2 and summary.policies["same-dc"].completed == 9
    # The report is rebuilt from the saved files alone, byte for byte.
    report = (out / "report.md").read_bytes()
    for name in ("report.md", "latency.png", "ttft_by_hit.png", "timeline.png"):
        (out / name).unlink()
    code, err = run_cli(["report", str(out)], capsys)
    assert code == 0, err
    assert (out / "report.md").read_bytes() == report
    assert all((out / name).stat().st_size > 0 for name in made)
    for s in range(3):
        for k in (1, 2):
            prev, cur = df.loc[f"t{s}.{k - 1}"], df.loc[f"t{s}.{k}"]
            # Sent only after the previous turn's last token, plus its delay (0.4 s).
            assert cur.sent >= prev.sent + prev.e2e_s + 0.4 - 0.01
            # The previous turn's prompt is a prefix of this one's and is reused for real.
            assert cur.prefill_hit_tokens >= 16 * ((prev.prompt_tokens - 1) // 16)
    assert (df.output_tokens == 3).all()


def test_a_failed_turn_ends_the_rest_of_its_session_with_a_reason(tmp_path: Path) -> None:
    trace = _sessions(tmp_path / "s.jsonl", n=2, turns=3, out_tokens=30, delay=0.1)
    specs = load_trace(trace).specs()
    sc = scenario_with()
    with Deployment(sc, parse_policy("same-dc"), worker_faults={"decode-a": WorkerFaults(die_after_tokens=40)}) as dep:
        recs = dep.run(TraceReplay(specs, timeout_s=60)).recs
    errors = {rid: r.error for rid, r in recs.items()}
    assert all(r.done for r in recs.values()), errors
    failed = [rid for rid, e in errors.items() if e]
    assert failed, errors
    for rid in failed:
        session, turn = rid.split(".")
        if int(turn) < 2:
            nxt = f"{session}.{int(turn) + 1}"
            if errors[rid] and "not sent" not in errors[rid]:
                # It was on decode-a when it died, its KV was on the way there (the transfer broke
                # before the death was announced), or it came after and found no decoder.
                why = errors[rid]
                assert "decode-a died" in why or "no live decode worker" in why or \
                    why.startswith("KV transfer to decode-a: "), why
                assert errors[nxt] == f"not sent: previous turn {rid} failed"
                assert not recs[nxt].sent
