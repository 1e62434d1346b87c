"""Least privilege: workers and the router drop root once set up, and still write their
results and open sockets in their namespaces; the kill fault signals only the process it
recorded."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testbed.net import netns, runstate
from workers import namespace
from workers.privilege import NamespaceSockets, OutDir, drop_privileges, no_new_privileges

from .conftest import UNPRIVILEGED as WHO
from .conftest import assert_unprivileged, needs_root, status_of

pytestmark = [needs_root, pytest.mark.hostile]

SIOCGSKNS = 0x894C


def in_child(body: Callable[[], None]) -> tuple[int, str]:
    """Run ``body`` in a forked child (privileges cannot come back in this process); returns
    its exit status and what it wrote."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        sys.stdout = sys.stderr = open(w, "w", buffering=1)  # noqa: SIM115 - the child's whole life
        code = 0
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - report it to the test
            print(f"{type(e).__name__}: {e}", flush=True)
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), text


def namespace_of(sock: socket.socket) -> int:
    """The inode of the network namespace ``sock`` was made in (``SIOCGSKNS``)."""
    fd = fcntl.ioctl(sock.fileno(), SIOCGSKNS)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str]]:
    prefix = f"pddt{secrets.token_hex(3)}"
    names = (f"{prefix}-one", f"{prefix}-two")
    try:
        for ns in names:
            netns.create_namespace(ns)
        yield names
    finally:
        for ns in names:
            netns.remove_namespace(ns)


def test_dropped_privileges_cannot_come_back_and_write_only_through_the_open_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    os.chown(out, WHO.uid, WHO.gid)
    secret = tmp_path / "secret"
    secret.write_text("root's")
    secret.chmod(0o600)
    (out / "link.json").symlink_to(secret)

    def body() -> None:
        folder = OutDir(out)
        drop_privileges(WHO)
        assert_unprivileged(os.getpid())
        folder.write_atomic("stats.json", '{"n": 1}')
        folder.append_line("deaths.jsonl", "one")
        folder.append_line("deaths.jsonl", "two")
        for attempt in (lambda: secret.read_text(), lambda: os.setuid(0)):
            try:
                attempt()
            except PermissionError:
                continue
            raise AssertionError("an unprivileged process did what only root may")
        try:
            folder.write_atomic("link.json", "x")  # replaces the link, never writes through it
            folder.open("link.json")  # now a file of its own
        except OSError as e:
            raise AssertionError(e) from e

    code, text = in_child(body)
    assert code == 0, text
    assert (out / "stats.json").read_text() == '{"n": 1}'
    assert (out / "deaths.jsonl").read_text() == "one\ntwo\n"
    assert secret.read_text() == "root's" and not (out / "link.json").is_symlink()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_every_thread_of_a_process_that_drops_root_has_no_new_privs_or_it_refuses_to_start() -> None:
    """``PR_SET_NO_NEW_PRIVS`` is per thread: a thread started before it could still exec a
    set-user-ID program. The processes set it first thing; a drop that finds a thread without
    it refuses, still root, before it changes credentials."""
    def sleeper() -> threading.Thread:
        t = threading.Thread(target=time.sleep, args=(3,), daemon=True)
        t.start()
        return t

    def early() -> None:
        sleeper()
        try:
            drop_privileges(WHO)
        finally:
            print(f"uid {os.getuid()}")

    code, text = in_child(early)
    assert code == 1 and "lack PR_SET_NO_NEW_PRIVS" in text and "uid 0" in text, text

    def first() -> None:
        no_new_privileges()
        t = sleeper()
        drop_privileges(WHO)
        assert status_of(os.getpid())["NoNewPrivs"] == "1"
        assert "NoNewPrivs:\t1" in Path(f"/proc/self/task/{t.native_id}/status").read_text()

    code, text = in_child(first)
    assert code == 0, text


def test_a_link_put_in_the_folder_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    out = tmp_path / "out"
    out.mkdir()
    (out / "records.jsonl").symlink_to(target)
    with pytest.raises(OSError) as e:
        OutDir(out).open("records.jsonl")
    assert e.value.errno == errno.ELOOP and target.read_text() == "untouched"
    (tmp_path / "folder-link").symlink_to(out)
    with pytest.raises(OSError):
        OutDir(tmp_path / "folder-link")


def test_an_unprivileged_process_gets_sockets_in_its_namespaces_and_only_those(
        two_namespaces: tuple[str, str]) -> None:
    one, two = two_namespaces
    inodes = {ns: os.stat(netns.NETNS_DIR / ns).st_ino for ns in two_namespaces}
    assert namespace_of(socket.socket()) not in inodes.values()
    ours, theirs = socket.socketpair()  # the child hands its sockets back to be checked as root

    def body() -> None:
        sockets = NamespaceSockets([one, two])
        namespace.use_socket_maker(sockets.tcp_socket)
        drop_privileges(WHO)
        assert_unprivileged(os.getpid())
        try:
            namespace.make_tcp_socket(one)  # entering a namespace needs root
        except PermissionError:
            pass
        else:
            raise AssertionError("setns worked without privileges")
        for ns in (one, two, one):
            with namespace.tcp_socket(ns) as s:
                socket.send_fds(theirs, [ns.encode()], [s.fileno()])
        try:
            sockets.tcp_socket("another")
        except ValueError:
            pass
        else:
            raise AssertionError("a namespace outside the list")
        helper = sockets.pid
        assert int(status_of(helper)["Uid"].split()[0]) == 0  # the helper alone stays root
        print(helper, flush=True)

    code, text = in_child(body)
    assert code == 0, text
    with ours, theirs:
        for want in (one, two, one):
            msg, fds, _, _ = socket.recv_fds(ours, 64, 1)
            assert msg.decode() == want and len(fds) == 1
            with socket.socket(fileno=fds[0]) as s:
                assert namespace_of(s) == inodes[want], want
    helper = int(text.split()[-1])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{helper}").exists() and time.monotonic() < deadline:  # it ends with its parent
        with_zombie = status_of(helper).get("State", "").startswith("Z")
        if with_zombie:
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{helper}").exists() or status_of(helper)["State"].startswith("Z")


def test_the_kill_fault_signals_only_the_process_it_recorded() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = netns.proc_starttime(proc.pid)
        assert start is not None
        assert not netns.signal_exact(proc.pid, start + 1, signal.SIGKILL)  # another process under that PID
        assert proc.poll() is None
        assert netns.signal_exact(proc.pid, start, signal.SIGKILL)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert not netns.signal_exact(proc.pid, start, signal.SIGKILL)  # ended: nothing to signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_socket_pair_helper_refuses_what_is_not_an_index(two_namespaces: tuple[str, str]) -> None:
    sockets = NamespaceSockets(list(two_namespaces))
    try:
        sockets._sock.send(b"\x00\x00\x07")  # 3 bytes: not a request
        msg, fds, _, _ = socket.recv_fds(sockets._sock, 512, 1)
        assert not fds and msg == b"no such namespace"
        sockets._sock.send((9).to_bytes(2, "big"))
        msg, fds, _, _ = socket.recv_fds(sockets._sock, 512, 1)
        assert not fds and msg == b"no such namespace"
        with sockets.tcp_socket(two_namespaces[1]) as s:  # and serves on
            assert namespace_of(s) == os.stat(netns.NETNS_DIR / two_namespaces[1]).st_ino
    finally:
        sockets._sock.close()
        os.waitpid(sockets.pid, 0)


def test_what_an_unprivileged_process_left_is_read_only_if_it_is_a_plain_file(tmp_path: Path) -> None:
    (tmp_path / "stats.json").write_text("{}")
    assert runstate.read_nofollow(tmp_path / "stats.json") == "{}"
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "link.json").symlink_to(tmp_path / "stats.json")
    for name in ("fifo.json", "link.json"):
        with pytest.raises(OSError):
            runstate.read_nofollow(tmp_path / name)  # neither blocks nor follows
