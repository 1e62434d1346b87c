"""Worker processes forked from one that has already imported torch and transformers.

A worker's interpreter spends ~5 CPU-seconds importing torch and transformers before it does
anything, and a deployment starts several at once on a small host. The fork server pays that
once per orchestrator process: it imports the worker's code, then forks a child per worker,
which enters the host's network namespace, sends its output to the worker's log and runs
``workers.__main__.main`` as ``python -m workers`` would.

The contract, client and server both stated here:

- the orchestrator starts the server on first use, in its own namespace, with one end of a
  ``SOCK_SEQPACKET`` socket pair; one datagram per request (``LaunchRequest``), one per reply
  (``LaunchReply``: the worker's PID, or why it could not start). The orchestrator records
  the PID in the run like any process it starts, and ends it by that PID;
- the server never runs a torch operation (its children would inherit a thread pool they
  cannot use) and runs no thread of its own, so ``fork`` copies a consistent process;
- lifetimes: the server ends when the orchestrator closes the socket or dies (SIGTERM by
  ``PR_SET_PDEATHSIG``), and each worker gets SIGTERM when the server ends, so a ``kill -9``
  of the orchestrator still leaves no process behind. The server reaps its children.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import fcntl
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.validation import one_line
from testbed.deploy.accounts import component_env
from testbed.errors import BuildError
from testbed.net import netns

START_TIMEOUT_S = 180.0  # the first request waits for the server's imports on a busy host
MAX_DATAGRAM = 65536
ERROR_LINES = 20
PR_SET_NAME = 15


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ns: str
    config: str
    log: str
    name: str


class LaunchReply(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    pid: int | None = None
    error: str | None = None


# ----------------------------------------------------------------------------- client side
class ForkServer:
    """The orchestrator's handle on its fork server (one per process, started on first use)."""

    def __init__(self, module: str = "testbed.deploy.forkserver") -> None:
        self.module = module  # what runs as the server (``python -m``)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._said: collections.deque[str] = collections.deque(maxlen=ERROR_LINES)
        self._drain: threading.Thread | None = None

    def prestart(self) -> None:
        """Start the server now, if it is not running, without waiting for it: its imports
        then overlap whatever the orchestrator does before its first worker."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def launch(self, ns: str, config: Path, log: Path, name: str) -> int:
        """Start the worker configured in ``config`` inside ``ns``; returns its PID."""
        req = LaunchRequest(ns=ns, config=str(config), log=str(log), name=name)
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._sock is not None
            try:
                self._sock.send(req.model_dump_json().encode())
                data = self._sock.recv(MAX_DATAGRAM)
            except OSError as e:  # timeout and a server that died first included
                why = self._stop()
                raise BuildError(f"starting {name}: the worker fork server did not answer ({e}){why}") from e
            if not data:
                why = self._stop()
                raise BuildError(f"starting {name}: the worker fork server exited{why}")
            try:
                reply = LaunchReply.model_validate_json(data)
            except ValidationError as e:
                raise BuildError(f"starting {name}: bad reply from the fork server: {one_line(e)}") from e
            if reply.pid is None:
                raise BuildError(f"starting {name}: {reply.error or 'no reason given'}")
            return reply.pid

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.settimeout(START_TIMEOUT_S)
        try:
            self._proc = netns.spawn(None, [sys.executable, "-m", self.module, str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE)
        finally:
            theirs.close()
        self._sock = ours
        # Read what the server writes as it writes it (a full pipe would stop it), keeping
        # the last lines for an error message.
        self._said.clear()
        out = self._proc.stderr
        assert out is not None
        self._drain = threading.Thread(target=lambda: self._said.extend(
            line.decode(errors="replace").rstrip() for line in out), name="forkserver-stderr", daemon=True)
        self._drain.start()

    def _stop(self) -> str:
        """Close the socket (the server ends on it) and reap the server; returns the tail of
        what it wrote, for an error message."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._drain is not None:
            self._drain.join(timeout=2)
        tail = " | ".join(line for line in list(self._said)[-3:] if line)
        return f" (status {proc.returncode}{': ' + tail if tail else ''})"

    def close(self) -> None:
        """At exit: the workers are gone by now, and a server still importing (a command that
        stopped at its input checks) would otherwise be waited for until it reads its socket."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
            self._stop()


_SERVER = ForkServer()
atexit.register(_SERVER.close)


def prestart() -> None:
    """Have the fork server importing while the orchestrator builds the rest."""
    _SERVER.prestart()


def launch_worker(ns: str, config: Path, log: Path, name: str) -> int:
    """Fork a worker for ``config`` inside namespace ``ns`` (output to ``log``); its PID."""
    return _SERVER.launch(ns, config, log, name)


# ----------------------------------------------------------------------------- server side
def _reap(_sig: int, _frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def serve(fd: int) -> None:
    """The server's loop: one request, one fork, one reply, until the socket closes."""
    # torch, and transformers (``workers.model``): why this process exists. A worker that runs
    # a model imports the latter as it starts (``workers.runtime``), ~2.5 CPU-seconds each,
    # unless the process it was forked from already has.
    import workers.model  # noqa: F401
    from workers.__main__ import main as worker_main

    sock = socket.socket(fileno=fd)
    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    netns.die_with_parent()
    signal.signal(signal.SIGCHLD, _reap)
    # What the imports allocated lives as long as every child: frozen, no collector pass in
    # any worker scans it again, and its pages stay shared.
    gc.collect()
    gc.freeze()
    me = os.getpid()
    while True:
        data = sock.recv(MAX_DATAGRAM)
        if not data:
            return
        try:
            req = LaunchRequest.model_validate_json(data)
        except ValidationError as e:
            sock.send(LaunchReply(error=f"bad launch request: {one_line(e)}").model_dump_json().encode())
            continue
        reply = LaunchReply(error=f"namespace {req.ns} does not exist")
        if (netns.NETNS_DIR / req.ns).exists():
            reply = _fork_worker(req, sock, me, worker_main)
        sock.send(reply.model_dump_json().encode())


def _fork_worker(req: LaunchRequest, sock: socket.socket, me: int, worker_main: Callable[[str], None]) -> LaunchReply:
    """Fork, and answer once the child is in its namespace with its log open (it says so on
    a pipe), so the PID the orchestrator records is already the worker it describes."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(ready_r)
        os.close(ready_w)
        return LaunchReply(error=f"fork failed: {e}")
    if pid == 0:
        os.close(ready_r)
        _become_worker(req, sock, me, ready_w, worker_main)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        ok = ready.read(1)
    if not ok:
        return LaunchReply(error=f"{req.name} ended while it started: see {req.log}")
    return LaunchReply(pid=pid)


def _become_worker(req: LaunchRequest, sock: socket.socket, server_pid: int, ready: int,
                   worker_main: Callable[[str], None]) -> NoReturn:
    """The forked child: the worker's log, namespace, session and signals, then its main."""
    code = 1
    try:
        sock.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.setsid()
        env = component_env()  # not root's shell's: its credentials, tokens and proxies stay with root
        os.environ.clear()
        os.environ.update(env)
        netns.die_with_parent()
        if os.getppid() != server_pid:  # the server ended before the line above
            os._exit(1)
        netns.join(req.ns)
        ctypes.CDLL(None).prctl(PR_SET_NAME, req.name.encode()[:15], 0, 0, 0)
        os.write(ready, b"1")
        os.close(ready)
        sys.argv = ["workers", req.config]
        worker_main(req.config)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit("usage: python -m testbed.deploy.forkserver FD (started by the orchestrator)")
    serve(int(sys.argv[1]))
