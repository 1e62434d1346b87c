"""The state folder and its manifests are not trusted: a folder another user could have made
is refused, manifests are checked before anything is killed or deleted, no link is followed,
and a live run's namespaces are safe from a clean under another state root."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.net import netns, runstate

from .conftest import needs_root


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "state"
    monkeypatch.setattr(runstate, "STATE_ROOT", state)
    return state


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _manifest(root: Path, folder: str, **fields: object) -> Path:
    d = root / folder
    d.mkdir(parents=True, mode=0o700)
    data = {"run_id": folder, "owner_pid": 999999999, "owner_starttime": 1, "created": 0.0,
            "namespaces": [], "processes": [], "info": {}}
    data.update(fields)
    (d / "manifest.json").write_text(json.dumps(data))
    return d


def test_a_new_state_root_is_private_and_a_run_folder_too(root: Path) -> None:
    run = runstate.Run.new()
    try:
        assert os.stat(root).st_mode & 0o777 == runstate.ROOT_MODE
        assert os.stat(run.dir).st_mode & 0o777 == runstate.ROOT_MODE
        assert os.stat(run.dir / "manifest.json").st_mode & 0o777 == 0o600
    finally:
        run.destroy()
    assert not run.dir.exists()


def test_a_state_root_others_may_write_or_a_link_is_refused(root: Path, tmp_path: Path) -> None:
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(InputError, match="writable by group or others"):
        runstate.clean_stale()
    with pytest.raises(InputError, match="refusing"):
        runstate.Run.new()
    root.rmdir()
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    root.symlink_to(real)
    with pytest.raises(InputError, match="not a directory"):
        runstate.live_runs()


@needs_root
def test_a_state_root_of_another_user_is_refused(root: Path) -> None:
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # nobody
    with pytest.raises(InputError, match="belongs to uid 65534"):
        runstate.clean_stale()


def test_a_manifest_kills_only_a_process_it_names_with_its_start_time(root: Path,
                                                                      sleeper: subprocess.Popen[bytes]) -> None:
    root.mkdir(mode=0o700)
    pid, start = sleeper.pid, netns.proc_starttime(sleeper.pid)
    # A dead owner makes the run stale; its records are a bare PID, a wrong start time, a
    # namespace of another run and a folder that is not a run id: nothing is killed.
    bare = {"pid": pid, "starttime": None, "name": "x", "ns": "pdd000001-h"}
    _manifest(root, "000001", processes=[bare])
    _manifest(root, "000002", processes=[{**bare, "starttime": (start or 0) + 1}])
    os.utime(_manifest(root, "000003", namespaces=["pdd0000ff-h"], processes=[{**bare, "starttime": start}]),
             (0, 0))  # an unreadable manifest is judged by its folder's age
    _manifest(root, "not-a-run", processes=[{**bare, "starttime": start}])
    runstate.clean_stale()
    assert sleeper.poll() is None
    assert not (root / "000001").exists() and not (root / "000002").exists()
    assert (root / "000003").exists() is False  # unreadable and old: removed, its PID untouched
    assert (root / "not-a-run").exists()  # not a run's folder: left alone
    # The same record with its start time, in a valid manifest: that process is the run's.
    _manifest(root, "000004", processes=[{**bare, "starttime": start}])
    runstate.clean_stale()
    assert sleeper.wait(timeout=10) is not None


def test_bad_manifests_are_errors_not_actions(root: Path) -> None:
    for run_id, fields in [("00000a", {"run_id": "00000b"}), ("00000c", {"namespaces": ["pdd00000c-../../x"]}),
                           ("00000d", {"processes": [{"pid": 1, "starttime": 1, "name": "init", "ns": "x"}]}),
                           ("00000e", {"owner_pid": "1"})]:
        d = _manifest(root, run_id, **fields)
        with pytest.raises(ValueError):
            runstate.Run.load(d / "manifest.json")
    with pytest.raises(ValueError, match="not a run id"):
        runstate.destroy("../etc", [], [])


def test_saving_replaces_a_planted_link_instead_of_writing_through_it(root: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    run = runstate.Run.new()
    try:
        (run.dir / "manifest.json").unlink()
        (run.dir / "manifest.json").symlink_to(victim)
        run.save()
        assert victim.read_text() == "untouched"
        assert not (run.dir / "manifest.json").is_symlink()
        (run.dir / "manifest.json").unlink()
        os.symlink(victim, run.dir / "manifest.json")
        with pytest.raises(OSError):
            runstate.Run.load(run.dir / "manifest.json")  # never read through a link
    finally:
        run.destroy()


@needs_root
def test_a_live_runs_namespaces_survive_a_clean_under_another_state_root(root: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = runstate.Run.new()
    ns, building = f"{run.prefix}-h1", f"{run.prefix}-h2"
    try:
        for n in (ns, building):
            run.add_namespace(n)
            netns.create_namespace(n)
        run.hold(ns)  # the other one is mid-build: made, not yet locked
        other = root.parent / "other-state"
        runstate.STATE_ROOT = other  # monkeypatched back by the fixture
        # This root knows nothing of the run: the lock protects one, its age the other; and the
        # young one is no door to the held one (the run's other namespaces are not swept with it).
        runstate.clean_stale()
        assert {ns, building} <= set(netns.list_namespaces())
        monkeypatch.setattr(runstate, "BUILD_GRACE_S", 0.0)  # seconds later, still not locked
        assert runstate.clean_stale() == [f"namespace {building}"]
        assert ns in netns.list_namespaces()
        run.release()
        assert f"namespace {ns}" in runstate.clean_stale()
    finally:
        runstate.STATE_ROOT = root
        run.destroy()
    assert ns not in netns.list_namespaces() and building not in netns.list_namespaces()
