"""--executor ray on a local cluster of two nodes (127.0.0.1), each offering one testbed_host:
a simulated sweep gives the tables a local one gives, a replay whose worker is killed is sent
again and nothing is lost, one that fails on every try is recorded in its folder and named
missing, and --resume keeps what came back. Ray is optional (make setup CLUSTER=1): without
it these are skipped and ``--executor ray`` is a clear error (exit 4), tested either way."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.errors import EXIT_INTERRUPTED
from testbed.experiments.ray_executor import FAILED_FILE, HOST_RESOURCE, PLACEMENT_FILE, TASK_LOG, placement
from testbed.experiments.trace_run import RunOptions
from testbed.traces.generate import generate

from .conftest import ROOT, run_cli

# One cluster for the module: under make test's parallel part its tests stay on one worker.
pytestmark = pytest.mark.xdist_group("ray")

TRACE = ROOT / "traces" / "agentic-quick.jsonl"
SWEEP = ["sweep", "--engine", "sim", "--trace", str(TRACE), "--token-scale", "16", "--load", "0.5:1:0.5",
         "--limit", "40", "--policies", "same-dc,pdd", "--jobs", "1"]


def test_an_emulation_claims_its_host_and_a_simulation_one_core() -> None:
    assert placement(RunOptions(engine="emulation")) == {"num_cpus": 0, "resources": {HOST_RESOURCE: 1}}
    assert placement(RunOptions(engine="sim")) == {"num_cpus": 1}


def test_without_ray_or_a_cluster_the_executor_is_a_clear_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, err = run_cli([*SWEEP, "--out", str(tmp_path / "a"), "--executor", "ray"], capsys)
    assert code == 2 and "--ray-address" in err, err
    # Ray missing, or no cluster at the address: exit 4, saying which (never a wait on a head that is not there).
    code, err = run_cli([*SWEEP, "--out", str(tmp_path / "b"), "--executor", "ray", "--ray-address", "127.0.0.1:1"],
                        capsys)
    assert code == 4 and ("make setup CLUSTER=1" in err or "no Ray cluster answers at 127.0.0.1:1" in err), err


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # Both nodes on this host, at its own address (a driver told 127.0.0.1 is sent to that
    # address by the head and waits forever): nothing leaves the machine; no usage reports.
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    node = {"num_cpus": 1, "resources": {HOST_RESOURCE: 1}, "object_store_memory": 80 << 20}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        c.add_node(**node)
        c.wait_for_nodes()
        yield c.address
    finally:
        ray.shutdown()
        c.shutdown()


def _rows(folder: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted(folder.glob("load-*/requests.csv"))}


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "sweep"
    from testbed.cli.main import main

    assert main([*SWEEP, "--out", str(out)]) == 0
    return out


def _cmdline(pid: int | str) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _killer(name: str, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL, once, the cluster's worker process that runs the replay ``name`` (Ray titles a
    task's process ``ray::<task name>``): a worker dying mid-replay, as on a node's OOM. Not a
    child it forked (same title until its exec): killing that fails nothing Ray sees."""
    title = f"ray::testbed replay {name}"
    while not stop.is_set() and not killed:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or not _cmdline(d.name).startswith(title):
                continue
            try:
                parent = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if not _cmdline(parent).startswith(title):
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
                return
        time.sleep(0.05)


def _sweep_with_a_kill(argv: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[int]]:
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_killer, args=(name, stop, killed), daemon=True)
    t.start()
    try:
        code, err = run_cli(argv, capsys)
    finally:
        stop.set()
        t.join()
    return code, err, killed


def test_a_simulated_sweep_on_the_cluster_gives_the_local_tables(cluster: str, local: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    code, err = run_cli([*SWEEP, "--out", str(out), "--executor", "ray", "--ray-address", cluster], capsys)
    assert code == 0, err
    assert _rows(out) == _rows(local) and len(_rows(out)) == 2  # byte for byte
    assert (out / "sweep.md").read_text() == (local / "sweep.md").read_text()
    for d in out.glob("load-*"):
        summary = json.loads((d / "summary.json").read_text())
        assert "/" in summary["node"] and summary["wall_s"] > 0  # host/node id, and how long it took there
        assert "trace" in (d / TASK_LOG).read_text()  # what the replay printed on its node
    assert not list(out.rglob(".*.tmp"))
    # --resume: what came back is kept, nothing replayed again.
    code, err = run_cli([*SWEEP, "--out", str(out), "--executor", "ray", "--ray-address", cluster, "--resume"], capsys)
    assert code == 0, err
    assert all("--resume: kept from" in (d / TASK_LOG).read_text() for d in out.glob("load-*"))
    assert _rows(out) == _rows(local)


def test_a_replay_whose_worker_dies_is_sent_again_and_nothing_is_lost(cluster: str, local: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    code, err, killed = _sweep_with_a_kill([*SWEEP, "--out", str(out), "--executor", "ray", "--ray-address", cluster],
                                           "load-1", capsys)
    assert killed, "the replay's worker was never seen"
    assert code == 0, err
    assert _rows(out) == _rows(local)
    assert not list(out.rglob(FAILED_FILE))


def test_a_replay_that_dies_on_every_try_is_recorded_and_named_missing(cluster: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    # The whole trace under three policies: seconds of replay, so the kill lands while it runs
    # (one that lands after the replay returned would fail nothing).
    code, err, killed = _sweep_with_a_kill([*SWEEP, "--limit", "117", "--policies", "same-dc,cross-dc,pdd",
                                            "--out", str(out), "--executor", "ray", "--ray-address", cluster,
                                            "--ray-retries", "0"], "load-1", capsys)
    assert killed and code == 1, err
    why = json.loads((out / "load-1" / FAILED_FILE).read_text())["failed"]
    assert "died" in why.lower() or "worker" in why.lower(), why
    assert "missing: load-1" in err and "1 replays missing" in err
    assert (out / "load-0.5" / "summary.json").exists()  # the other point is in the table
    assert "| 0.5 |" in (out / "sweep.md").read_text() and "| 1 |" not in (out / "sweep.md").read_text()


def test_tune_runs_its_trials_side_by_side_on_the_cluster(cluster: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    code, err = run_cli(["tune", "--engine", "sim", "--trace", str(TRACE), "--token-scale", "16", "--limit", "30",
                         "--trials", "4", "--seeds", "1", "--executor", "ray", "--ray-address", cluster,
                         "--concurrent-trials", "2", "--out", str(out)], capsys)
    assert code == 0, err
    result = json.loads((out / "tune.json").read_text())
    assert [t["number"] for t in result["trials"]] == [0, 1, 2, 3] and result["front"]  # in order, whatever ended first
    nodes = {json.loads((out / f"trial-{n:03d}" / "summary.json").read_text())["node"] for n in range(4)}
    assert all("/" in n for n in nodes)
    # Locally, one trial at a time: asking for more is an error, not a silent serial run.
    code, err = run_cli(["tune", "--engine", "sim", "--trace", str(TRACE), "--token-scale", "16", "--limit", "30",
                         "--trials", "4", "--concurrent-trials", "2", "--out", str(tmp_path / "t2")], capsys)
    assert code == 2 and "--concurrent-trials" in err


def _replay_processes() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and _cmdline(d.name).startswith("ray::testbed replay")]


def test_ctrl_c_cancels_the_clusters_replays(cluster: str, tmp_path: Path) -> None:
    # Eight replays of the whole trace (seconds each): some running, some waiting, when Ctrl-C comes.
    argv = [sys.executable, "-m", "testbed", "sweep", "--engine", "sim", "--trace", str(TRACE), "--token-scale", "16",
            "--load", "0.25:2:0.25", "--policies", "same-dc,cross-dc,pdd", "--out", str(tmp_path / "sweep"),
            "--executor", "ray", "--ray-address", cluster]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        # The driver has sent its replays and one of them is running on a node.
        while not (any("replays sent" in x for x in lines) and _replay_processes()):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        output = "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, output[-3000:]
    assert "cancelling" in output
    deadline = time.monotonic() + 30
    while _replay_processes() and time.monotonic() < deadline:  # cancelled, not left to finish
        time.sleep(0.2)
    assert not _replay_processes()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_emulations_never_share_a_host(cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three short emulated replays on two nodes of one testbed_host each: by their records
    (node, start and end), no two ever ran on one node at once."""
    out = tmp_path / "sweep"
    code, err = run_cli(["sweep", "--scenario", str(ROOT / "topologies" / "two-dc-modeled.yaml"), "--trace", str(TRACE),
                         "--token-scale", "16", "--load", "1:3:1", "--limit", "2", "--policies", "same-dc",
                         "--dilation", "1", "--executor", "ray", "--ray-address", cluster, "--out", str(out)], capsys)
    assert code == 0, err
    runs = [json.loads((out / f"load-{x}" / PLACEMENT_FILE).read_text()) for x in (1, 2, 3)]
    assert all(r["exit"] in (0, 1, 3) for r in runs) and len({r["node"] for r in runs}) <= 2
    for a in runs:
        for b in runs:
            if a is not b and a["node"] == b["node"]:
                assert a["ended"] <= b["started"] or b["ended"] <= a["started"], runs
    assert all(json.loads((out / f"load-{x}" / "summary.json").read_text())["engine"] == "emulation" for x in (1, 2, 3))


def test_a_nodes_files_are_written_inside_the_folder_or_refused(tmp_path: Path) -> None:
    from testbed.experiments.ray_executor import write_files

    write_files(tmp_path / "run", {"summary.json": b"{}", "logs/router.log": b"x"})
    assert (tmp_path / "run" / "logs" / "router.log").read_bytes() == b"x"
    for bad in ("../escape", "/etc/passwd", "logs/../../escape"):
        with pytest.raises(ValueError, match="not a file of its folder"):
            write_files(tmp_path / "run", {bad: b"x"})
    assert not (tmp_path / "escape").exists()


def test_bench_scale_climbs_its_sizes_side_by_side_on_the_cluster(cluster: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``bench scale --executor ray``: each round's replays (one per size still climbing) are
    tasks, emulations one per node; the table names every size, each from its own replay."""
    from testbed.bench import scale

    # Short answers and turns close together: the recipe's would make each replay minutes long.
    short = {"turns_max": 3, "think_mean_s": 0.1, "open_tpot_s": 0.001, "first_output_median": 48, "output_median": 32}
    monkeypatch.setattr(scale, "generate", lambda cfg: generate(dataclasses.replace(cfg, **short)))
    out = tmp_path / "scale"
    code, err = run_cli(["bench", "scale", "--sizes", "3,4", "--window", "2", "--per-device-rps", "0.5",
                         "--start-dilation", "2", "--executor", "ray", "--ray-address", cluster,
                         "--out", str(out)], capsys)
    assert code in (0, 1), err  # 1: a size whose ladder found no dilation that passed (named in the table)
    points = json.loads((out / "scale.json").read_text())["points"]
    assert [p["size"] for p in points] == [3, 4] and all(p["requests"] > 0 for p in points), points
    runs = [json.loads((Path(p["run_dir"]) / PLACEMENT_FILE).read_text()) for p in points]
    for a in runs:
        for b in runs:
            if a is not b and a["node"] == b["node"]:
                assert a["ended"] <= b["started"] or b["ended"] <= a["started"], runs
    # Each size from its own replays: one per dilation its ladder tried (more than one where a
    # loaded host failed the first verdict; the test asserts the climb, not this host's speed).
    assert all(p["attempts"] and len({a.split(":")[0] for a in p["attempts"]}) == len(p["attempts"])
               and not any("lost" in a for a in p["attempts"]) for p in points), points
