"""Root's own file writes and reads never go through what another account controls (root):
run folders and caches in a checkout an unprivileged account made, links planted at every
path root writes, a component folder nested 1,100 deep or swapped for a link. Each refused
or contained: root writes and reads no file outside the run."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from testbed.deploy import dilation_cache
from testbed.net.build import root_logs
from testbed.outputs import UnsafeFolder, atomic_path, new_run_dir, open_folder, write_atomic
from testbed.root_paths import remove_tree

from .conftest import needs_root

pytestmark = [needs_root, pytest.mark.hostile]
NOBODY = pwd.getpwnam("nobody")


def _as_nobody(*paths: Path) -> None:
    for p in paths:
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only root may touch: what a planted link points root at."""
    p = tmp_path / "secret"
    p.write_text("root's")
    p.chmod(0o600)
    return p


def test_a_folder_another_account_owns_or_can_write_is_refused_naming_it_and_the_fix(tmp_path: Path,
                                                                                       secret: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _as_nobody(theirs)
    (theirs / "summary.json").symlink_to(secret)
    with pytest.raises(UnsafeFolder, match=r"theirs: a folder owned by uid \d+.*chown root: .*theirs"):
        write_atomic(theirs / "summary.json", "{}")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolder, match="writable by other accounts"):
        write_atomic(shared / "x.csv", "a")
    assert secret.read_text() == "root's" and not list(shared.iterdir())


def test_a_link_another_account_planted_on_the_way_is_refused(tmp_path: Path, secret: Path) -> None:
    """``runs`` (another account's, as when it ran the simulator first) swapped for a link to
    a folder of root's: root follows no link it does not own."""
    target = tmp_path / "etc"
    target.mkdir()
    theirs = tmp_path / "checkout"
    theirs.mkdir()
    (theirs / "runs").symlink_to(target)
    _as_nobody(theirs, theirs / "runs")
    with pytest.raises(UnsafeFolder, match="a link owned by uid"):
        open_folder(theirs / "runs" / "x")
    with pytest.raises(UnsafeFolder):
        new_run_dir("", under=theirs / "runs")
    assert not list(target.iterdir())
    # A link root owns (a system's /var/run -> /run, say) is followed.
    (tmp_path / "mine").symlink_to(target)
    os.close(open_folder(tmp_path / "mine" / "sub"))
    assert (target / "sub").is_dir()


def test_a_run_folder_in_another_accounts_runs_is_roots_and_written_through_its_descriptor(
        tmp_path: Path, secret: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    _as_nobody(runs)
    out = new_run_dir("", under=runs)
    st = os.stat(out)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755)
    # A link planted at the file's own name is replaced, never followed.
    (out / "report.md").symlink_to(secret)
    write_atomic(out / "report.md", "# report")
    assert secret.read_text() == "root's" and (out / "report.md").read_text() == "# report"
    assert not (out / "report.md").is_symlink()
    # Renamed away while written: the bytes go to the folder root opened, not to what the
    # path names by then (another account's folder at the same name).
    with atomic_path(out / "summary.json") as tmp:
        os.rename(out, tmp_path / "moved")
        decoy = tmp_path / "runs" / out.name
        decoy.mkdir()
        _as_nobody(decoy)
        tmp.write_text("{}")
    assert (tmp_path / "moved" / "summary.json").read_text() == "{}" and not list(decoy.iterdir())
    assert not [p for p in (tmp_path / "moved").iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_cache_another_account_owns_is_neither_read_nor_written(tmp_path: Path, secret: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    _as_nobody(cache)
    monkeypatch.setenv(dilation_cache.CACHE_ENV, str(cache))
    (cache / "k.json").symlink_to(secret)
    assert dilation_cache.recall("k") is None
    dilation_cache.remember("k", 3.0, "probe")
    out = capsys.readouterr().out
    assert "ignoring" in out and "not kept" in out and "owned by uid" in out
    assert secret.read_text() == "root's" and (cache / "k.json").is_symlink()


def test_a_component_folder_nested_deep_or_swapped_for_a_link_is_neither_walked_nor_followed(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "router.log").write_text("router")
    broker = run / "broker"
    broker.mkdir(mode=0o750)
    (broker / "mosquitto.log").write_text("broker")
    out = run / "out"
    out.mkdir()
    # 1,100 folders deep (shutil.rmtree and rglob recursed past Python's limit on it).
    fd = os.open(out, os.O_RDONLY)
    for _ in range(1100):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("x.log", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    # And a listed subfolder swapped for a link to root's own logs.
    private = tmp_path / "var-log"
    private.mkdir(mode=0o700)
    (private / "auth.log").write_text("root-only")
    (out / "logs").symlink_to(private)
    _as_nobody(out)
    assert root_logs(run) == [broker / "mosquitto.log", run / "router.log"]
    remove_tree(run)
    assert not run.exists()
    assert (private / "auth.log").read_text() == "root-only"  # the link went, not what it named


def test_a_topo_file_another_account_could_have_written_is_not_executed(tmp_path: Path) -> None:
    from testbed.errors import InputError
    from testbed.net.topo_import import load_topo_class

    topo = tmp_path / "mine.py"
    marker = tmp_path / "ran"
    topo.write_text(f"open({str(marker)!r}, 'w').close()\nfrom mininet.topo import Topo\nclass T(Topo):\n    pass\n")
    _as_nobody(topo)
    with pytest.raises(InputError, match=r"--topo: .*mine.py: refused as root: .*owned by uid"):
        load_topo_class(f"{topo}:T")
    assert not marker.exists()


def test_a_forged_stats_file_and_a_malformed_records_line_cost_only_their_writer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from protocol.router_config import WorkerDeath
    from testbed.deploy.cluster import Cluster, _parsed_lines

    good = '{"worker": "decode-a", "role": "decode", "device": {"device": "native"}}'
    forged = good.replace('"decode-a"', '"prefill"')
    (tmp_path / "a.json").write_text(good)
    (tmp_path / "b.json").write_text(forged)
    (tmp_path / "c.json").write_text("{not json")
    fake = SimpleNamespace(workers={
        "decode-a": SimpleNamespace(name="decode-a", stats_path=str(tmp_path / "a.json")),
        "decode-b": SimpleNamespace(name="decode-b", stats_path=str(tmp_path / "b.json")),
        "relay": SimpleNamespace(name="relay", stats_path=str(tmp_path / "c.json"))})
    stats = Cluster.worker_stats(fake)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert list(stats) == ["decode-a"]
    assert "decode-b: statistics refused: its file names worker 'prefill'" in err and "relay: statistics refused" in err
    death = '{"worker": "decode-b", "news_t": 1.0, "t": 1.5, "why": "died"}'
    lines = "\n".join([death, "{half a line", death.replace("decode-b", "relay")])
    assert [d.worker for d in _parsed_lines(lines, WorkerDeath.model_validate_json, "deaths")] == ["decode-b", "relay"]
    assert "deaths: skipped 1 malformed line(s) (line 2:" in capsys.readouterr().err
