"""Run folders: written whole or not at all, never shared by two runs, each policy saved as it
ends with its processes' logs, so an interrupted run keeps what it finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from testbed.analysis.results import load_run
from testbed.errors import EXIT_INTERRUPTED
from testbed.outputs import atomic_path, new_run_dir, write_atomic

from .conftest import ROOT, TOPOLOGIES


def test_an_atomic_write_leaves_the_old_file_when_it_fails(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("crashed while writing")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    write_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261202-120000")
    first, second, third = new_run_dir("sweep"), new_run_dir("sweep"), new_run_dir("")
    assert (first.name, second.name, third.name) == ("sweep-20261202-120000", "sweep-20261202-120000-2",
                                                     "20261202-120000")
    assert first.is_dir() and second.is_dir() and third.is_dir()


def test_an_interrupted_run_keeps_the_policies_it_finished_and_their_logs(tmp_path: Path) -> None:
    raw = yaml.safe_load((TOPOLOGIES / "paper.yaml").read_text())  # modeled: no model to load, quick
    keep = {"client", "router", "prefill-1", "relay", "decode-a1", "decode-b1"}
    for dc in raw["datacenters"].values():
        dc["hosts"] = {h: spec for h, spec in dc["hosts"].items() if h in keep}
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump(raw))
    trace = tmp_path / "t.jsonl"
    # The last session starts 16 emulated s in: each policy's replay lasts that long, so the
    # interrupt lands inside the second policy (its 3 requests alone ended before it once, and
    # at 6 s in, a clean clone's make test, its host busy with the parallel part, saw the whole
    # second policy end before the interrupt came).
    trace.write_text("".join(json.dumps({"session": f"s{i}", "start_s": start, "turns": [
        {"new_tokens": 2000, "output_tokens": 200}]}) + "\n" for i, start in enumerate((0.0, 0.2, 16.0))))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--scenario", str(scenario), "--trace", str(trace),
                             "--token-scale", "16", "--policies", "same-dc,cross-dc", "--dilation", "0.5",
                             "--allow-infidelity", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not (out / "summary.json").exists():  # saved when the first policy ends
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first policy did not end in 900 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # the second policy is being built or replayed
        output = proc.communicate(timeout=120)[0]
        rc = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == EXIT_INTERRUPTED, output[-3000:]
    summary, df = load_run(out)
    assert list(summary.policies) == ["same-dc"] and len(df) == 3 and set(df.policy) == {"same-dc"}
    logs = {p.name for p in (out / "logs" / "same-dc").iterdir()}
    assert {"router.log", "broker-mosquitto.log", "delayline.log"} <= logs, logs
    assert any(n.startswith("worker") for n in logs), logs
    assert "mosquitto" in (out / "logs" / "same-dc" / "broker-mosquitto.log").read_text()  # whole, not just named
    assert not list(out.glob(".*.tmp*")), "no half-written file left behind"

    # --resume keeps the finished policy and runs only the other one.
    argv = [sys.executable, "-m", "testbed", "run", "--scenario", str(scenario), "--trace", str(trace),
            "--token-scale", "16", "--policies", "same-dc,cross-dc", "--dilation", "0.5", "--allow-infidelity",
            "--out", str(out), "--resume"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    assert f"--resume: kept from {out}: same-dc" in done.stdout
    resumed, df2 = load_run(out)
    assert list(resumed.policies) == ["same-dc", "cross-dc"] and len(df2) == 6
    assert resumed.policies["same-dc"] == summary.policies["same-dc"]
    assert df2[df2.policy == "same-dc"].ttft_s.tolist() == df.ttft_s.tolist()
    # A folder holding another run is refused, naming what differs; it is left as it was.
    other = subprocess.run([*argv, "--load", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "holds a different run (speed differs)" in other.stderr, other.stderr[-2000:]
    assert load_run(out)[0] == resumed

