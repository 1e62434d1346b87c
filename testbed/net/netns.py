"""Network-namespace primitives: enter a namespace, start a process in one, find its processes.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread* only, so
``entered(ns)`` lets the orchestrator open sockets or write sysctls inside a namespace and
return; a socket keeps the namespace it was created in. Processes are started directly in
their namespace (no ``ip netns exec``), in their own session, and receive SIGTERM if the
orchestrator dies (PR_SET_PDEATHSIG), so a ``kill -9`` of the orchestrator leaves at most
the namespaces themselves, which ``testbed clean`` removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from pyroute2 import IPRoute

from workers.namespace import CLONE_NEWNET, NETNS_DIR, entered, libc, setns_fd
from workers.privilege import no_new_privileges, open_regular

T = TypeVar("T")

PR_SET_PDEATHSIG = 1

MS_REC, MS_BIND, MS_SHARED = 0x4000, 0x1000, 1 << 20
MNT_DETACH = 2


def _mount_point(ns: str) -> Path:
    """The file a named namespace is bind-mounted on (created here, empty)."""
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    d = bytes(NETNS_DIR)
    # Make /run/netns a shared mount so the bind mounts propagate (what iproute2 does).
    if libc.mount(b"", d, b"none", MS_SHARED | MS_REC, None) != 0:
        libc.mount(d, d, b"none", MS_BIND | MS_REC, None)
        libc.mount(b"", d, b"none", MS_SHARED | MS_REC, None)
    path = NETNS_DIR / ns
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    return path


def attach_namespace(ns: str, pid: int) -> None:
    """Name the network namespace of process ``pid`` ``ns``, like ``ip netns attach``: it
    then outlives the process until ``remove_namespace``."""
    path = _mount_point(ns)
    if libc.mount(f"/proc/{pid}/ns/net".encode(), bytes(path), b"none", MS_BIND, None) != 0:
        err = ctypes.get_errno()
        with contextlib.suppress(OSError):
            path.unlink()
        raise OSError(err, f"bind mount of process {pid}'s namespace on {path} failed")


def create_namespace(ns: str) -> None:
    """Create a named namespace like ``ip netns add`` (bind mount under /run/netns).

    Done in a throwaway thread (unshare affects only the calling thread), not in a forked
    child: forking a multi-threaded orchestrator copies its signal handlers and state.
    """
    path = _mount_point(ns)
    errors: list[OSError] = []

    def _make() -> None:
        if libc.unshare(CLONE_NEWNET) != 0:
            errors.append(OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed"))
        elif libc.mount(b"/proc/thread-self/ns/net", bytes(path), b"none", MS_BIND, None) != 0:
            errors.append(OSError(ctypes.get_errno(), f"bind mount of {path} failed"))

    t = threading.Thread(target=_make, name=f"netns-{ns}")
    t.start()
    t.join()
    if errors:
        with contextlib.suppress(OSError):
            path.unlink()
        raise errors[0]


def remove_namespace(ns: str) -> None:
    """Unmount and delete a named namespace; it dies once no process is left inside."""
    path = NETNS_DIR / ns
    libc.umount2(bytes(path), MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@contextlib.contextmanager
def iproute(ns: str) -> Iterator[IPRoute]:
    """An rtnetlink handle bound inside ``ns`` (socket opened while the thread is there)."""
    with entered(ns):
        ipr = IPRoute()
        try:
            ipr.get_links(1)  # open the socket now, inside the namespace
            yield ipr
        finally:
            ipr.close()


def join(ns: str) -> None:
    """Move the calling thread into ``ns`` for good (for executor threads' initializer)."""
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        setns_fd(fd)
    finally:
        os.close(fd)


def die_with_parent() -> None:
    """This process gets SIGTERM when the thread that forked it ends."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exec_in(ns: str, argv: Sequence[str]) -> None:
    """Replace this process with ``argv`` running inside ``ns`` (stdin, stdout, stderr and
    the exit status are the command's own). Only from a process's main thread with no
    other thread that matters: setns moves the calling thread, and exec keeps only it."""
    join(ns)
    os.execvp(argv[0], list(argv))


def write_sysctl(ns: str, key: str, value: str | int) -> None:
    """Write a per-namespace sysctl such as ``net.ipv4.ip_forward``."""
    with entered(ns), open(Path("/proc/sys") / key.replace(".", "/"), "w") as f:
        f.write(str(value))


def ns_inode(ns: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / ns).st_ino
    except FileNotFoundError:
        return None


def list_namespaces() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def pids_in_namespace(ns: str) -> list[int]:
    """PIDs of every process whose network namespace is ``ns`` (matched by nsfs inode)."""
    ino = ns_inode(ns)
    if ino is None:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/net").st_ino == ino:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def proc_starttime(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot): guards against PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int, starttime: int | None) -> bool:
    """True if ``pid`` still runs the same process (a zombie counts as ended)."""
    st = proc_starttime(pid)
    return st is not None and (starttime is None or st == starttime) and _exists(pid)


def signal_exact(pid: int, starttime: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``starttime``;
    False if it has ended. The process is pinned by a pidfd before its start time is read,
    so a PID reused between the check and the signal cannot receive it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not is_alive(pid, starttime):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def terminate(pids: Sequence[int], grace_s: float = 2.0) -> None:
    """SIGTERM the given PIDs, then SIGKILL whatever is still alive after ``grace_s``."""
    pending = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            pending.add(pid)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            if not _exists(pid):
                pending.discard(pid)
        time.sleep(0.02)
    for pid in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_child(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM a child of ours (if it still runs), wait ``grace_s`` for it to finish what it
    does on SIGTERM, SIGKILL it otherwise; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exists(pid: int) -> bool:
    # Reap our own children so they do not linger as zombies (a zombie still "exists").
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def spawn(
    ns: str | None,
    argv: Sequence[str],
    *,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    stdout: int | None = None,
    stderr: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` inside namespace ``ns`` (None: this process's own); stdout+stderr go
    to ``log_path`` if given.

    The child gets SIGTERM when this process ends (``PR_SET_PDEATHSIG``). That signal fires
    when the *thread* that forked the child ends, not the process: a worker restarted from
    the fault injector's thread was terminated as soon as the fault timeline ended (a soak
    lost all four workers at its last fault). So only the main thread forks directly; any
    other thread hands the fork to one spawner thread that lives as long as the process.
    """
    args = (ns, list(argv), log_path, env, tuple(pass_fds), stdout, stderr)
    if threading.current_thread() is threading.main_thread():
        return _spawn(*args)
    return _spawner().submit(_spawn, *args).result()


_SPAWNER: list[ThreadPoolExecutor] = []
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    with _SPAWNER_LOCK:
        if not _SPAWNER:  # an executor's thread waits for work until the interpreter exits
            _SPAWNER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner"))
        return _SPAWNER[0]


def _spawn(ns: str | None, argv: list[str], log_path: Path | None, env: dict[str, str] | None,
           pass_fds: tuple[int, ...], stdout: int | None, stderr: int | None) -> subprocess.Popen[bytes]:
    ns_path = str(NETNS_DIR / ns) if ns else None
    if ns_path and not os.path.exists(ns_path):
        raise FileNotFoundError(f"namespace {ns} does not exist")

    def _in_child() -> None:
        if ns_path:
            fd = os.open(ns_path, os.O_RDONLY)
            setns_fd(fd)
            os.close(fd)
        die_with_parent()
        # Before exec, so every thread the program ever starts has it (it is per thread): no
        # process of a run gains privileges by exec (a set-user-ID program, file capabilities).
        no_new_privileges()

    # Root opens the log: never through a link, never a FIFO, 0600 (``open_regular``).
    out = open_regular(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if log_path else None
    try:
        return subprocess.Popen(
            argv,
            preexec_fn=_in_child,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else (out or subprocess.DEVNULL),
            stderr=stderr if stderr is not None else (out or subprocess.DEVNULL),
            env=env,
            pass_fds=pass_fds,
        )
    finally:
        if out is not None:
            os.close(out)
