"""Least privilege for the processes that parse network input: workers and the router.

They start as root (the orchestrator forks them inside a namespace), read their
configuration, load their model and open what they will write, then become an unprivileged
account (``workers.run_as``) before the first message arrives: no capabilities, no way back
(``PR_SET_NO_NEW_PRIVS``), no access to the state folder by path.

What they still need afterwards comes from things opened while root:

- ``OutDir``: a folder of the run owned by that account, reached through a descriptor
  (the state folder above it stays root-only 0700); files are written atomically in it.
- ``NamespaceSockets``: a process standing for hosts in several namespaces cannot enter
  them any more (``setns`` needs ``CAP_SYS_ADMIN``). A small child that stays root makes
  its TCP sockets in those namespaces, and only those, and hands them over a private
  socket pair (``SCM_RIGHTS``); a socket keeps the namespace it was made in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import NamedTuple

from workers import namespace

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


class Identity(NamedTuple):
    uid: int
    gid: int


def no_new_privileges() -> None:
    """``PR_SET_NO_NEW_PRIVS`` for this thread and every thread and child it creates after:
    called first thing in a process's main, before torch, an executor or anything else starts
    a thread (the flag is per thread; ``drop_privileges`` checks that every thread has it)."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _threads_without_no_new_privs() -> list[str]:
    missing = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            status = (task / "status").read_text()
            if "\nNoNewPrivs:\t1" not in status:
                missing.append(task.name)
    return missing


def drop_privileges(who: Identity | None) -> None:
    """Become ``who`` for good (``None``: stay as started). The parent-death signal that ties
    the process to its parent is cleared by a change of credentials, so it is set again; a
    parent that ended meanwhile ends this process."""
    if who is None:
        return
    _import_what_comes_later()
    no_new_privileges()
    missing = _threads_without_no_new_privs()
    if missing:  # a thread started before no_new_privileges() could still gain privileges by exec
        raise RuntimeError(f"threads {', '.join(missing)} lack PR_SET_NO_NEW_PRIVS: call no_new_privileges() "
                           "before any thread starts")
    parent = os.getppid()
    os.setgroups([])
    os.setresgid(who.gid, who.gid, who.gid)
    os.setresuid(who.uid, who.uid, who.uid)
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)
    if who.uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            return
        raise RuntimeError("root could be regained after dropping privileges")


def _import_what_comes_later() -> None:
    """Modules the standard library imports on first use, imported while privileged: the
    Python this runs on may live where the account cannot read (``/root/.pyenv``). Found by
    listing what the router and workers imported after this point over the root test suite:
    asyncio's default executor (aiomqtt resolves the broker on it), and the ``idna`` codec
    (with its tables) that ``getaddrinfo`` takes a host name through."""
    import concurrent.futures.thread  # noqa: F401
    import encodings.idna  # noqa: F401
    import queue  # noqa: F401
    import stringprep  # noqa: F401
    import unicodedata  # noqa: F401


def open_regular(path: str | Path, flags: int = os.O_RDONLY, dir_fd: int | None = None) -> int:
    """A descriptor for a regular file, opened as a privileged process must open anything an
    unprivileged one could have put there: never through a link (``O_NOFOLLOW``), never
    blocking on a FIFO (``O_NONBLOCK``, cleared once the file is known to be regular), created
    0600 when ``flags`` create it; anything but a regular file is refused."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class OutDir:
    """A folder opened while privileged; written through its descriptor afterwards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def open(self, name: str, mode: str = "w") -> int:
        """A descriptor for ``name`` in the folder (``w``: truncated, ``a``: appended), never
        through a link."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
        return open_regular(name, flags, dir_fd=self.fd)

    def write_atomic(self, name: str, text: str, mode: int = 0o600) -> None:
        tmp = f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        try:
            os.fchmod(fd, mode)  # whatever the umask
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:  # a full disk: no half-written temporary left beside the file
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def append_line(self, name: str, line: str) -> None:
        with os.fdopen(self.open(name, "a"), "a") as f:
            f.write(line + "\n")


class NamespaceSockets:
    """TCP sockets in a fixed list of namespaces, made by a root child of this process."""

    def __init__(self, namespaces: list[str]) -> None:
        self.namespaces = list(namespaces)
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; tests see it through its sockets
            ours.close()
            _serve_sockets(theirs, self.namespaces)
        theirs.close()
        self.pid, self._sock = pid, ours

    def tcp_socket(self, ns: str) -> socket.socket:
        """A non-blocking TCP socket made inside ``ns`` (one of the list)."""
        index = self.namespaces.index(ns)
        with self._lock:
            self._sock.send(index.to_bytes(2, "big"))
            msg, fds, _, _ = socket.recv_fds(self._sock, 512, 1)
        if not fds:
            raise OSError(f"no socket in namespace {ns}: {msg.decode(errors='replace')}")
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        return sock


def _serve_sockets(sock: socket.socket, namespaces: list[str]) -> None:
    """The root child: one socket per request, in the namespace the request's index names,
    until this process's parent closes its end or ends."""
    code = 0
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        while True:
            req = sock.recv(16)
            if not req:
                break
            index = int.from_bytes(req, "big") if len(req) == 2 else -1
            if not 0 <= index < len(namespaces):
                sock.send(b"no such namespace")
                continue
            try:
                made = namespace.make_tcp_socket(namespaces[index])
            except OSError as e:
                sock.send(str(e).encode()[:500])
                continue
            with made:
                socket.send_fds(sock, [b"ok"], [made.fileno()])
    except BaseException:  # noqa: BLE001 - the child must never return into its parent's code
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
