"""Run registry: every kernel object and process a run creates is recorded before it exists.

Each run gets an id and a name prefix (``pdd<6 hex>``) carried by all its namespaces. The
manifest (``<state root>/<id>/manifest.json``, in memory: see ``_state_root``) is written *before* the first namespace
is created and updated as processes start, so a crash at any point leaves enough behind for
``clean_stale`` to undo it: a run whose owner process is gone is stale. Processes are only
ever ended by PID (checked against their start time) or because they live inside one of
the run's own namespaces.

Nothing found on disk is trusted: the state root must belong to this user and be writable
by no one else (else every command refuses it, exit 2), manifests are read and written
without following symbolic links, and a run id, namespace name or PID from a manifest is
checked against the testbed's own patterns (and the PID against its start time) before
anything is killed, unmounted or deleted. A live run holds a shared ``flock`` on each of its
namespaces, so a clean from another state root never removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import signal
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.net import netns
from testbed.root_paths import read_nofollow, remove_tree, write_private, write_private_bytes, write_readable

# Where the run's files have always been read and written.
__all__ = ["read_nofollow", "write_private", "write_private_bytes", "write_readable"]


def _tmpfs(path: str) -> bool:
    """Whether ``path`` is a tmpfs mount point (/proc/self/mounts)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1] == path and fields[2] == "tmpfs":
                return True
    return False


def _state_root() -> Path:
    """Where runs keep their manifest, configs, logs and stats files: in memory. Workers
    and the delay line replace their stats file twice a second; on a disk filesystem
    (ext4 here, where /run is not a tmpfs) a rename now and then waited 0.2-0.6 s for the
    journal, with the event loop or the forwarding loop stopped: paced steps overran and
    delay-line frames were late by that much."""
    if env := os.environ.get("PDD_TESTBED_STATE"):
        return Path(env)
    return Path("/run/pdd-testbed") if _tmpfs("/run") else Path("/dev/shm/pdd-testbed")


STATE_ROOT = _state_root()
PREFIX_RE = re.compile(r"^pdd[0-9a-f]{6}-")
RUN_ID_RE = re.compile(r"^[0-9a-f]{6}$")
NS_RE = re.compile(r"^pdd[0-9a-f]{6}-[A-Za-z0-9][A-Za-z0-9._-]{0,40}$")
# Others may traverse (not list, not create): mosquitto, once it has dropped root for its own
# user, may still open its password, ACL and log files in its folder inside the run's (a reload
# reads them again).
ROOT_MODE = 0o711
BUILD_GRACE_S = 5.0  # a manifest or namespace this young may belong to a run mid-build


def check_state_root(create: bool = False) -> bool:
    """Whether the state root exists (creating it if ``create``); raises ``InputError`` for
    one that is not a real directory owned by this user and closed to writes by others:
    whoever made it could otherwise decide what the next clean kills and deletes."""
    if create:
        STATE_ROOT.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(STATE_ROOT, ROOT_MODE)
            os.chmod(STATE_ROOT, ROOT_MODE)  # whatever the umask
    try:
        st = os.lstat(STATE_ROOT)
    except FileNotFoundError:
        return False
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symbolic link?)"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        raise InputError(f"state folder {STATE_ROOT} {problem}: refusing to use it. Remove it if it is not "
                         f"yours, or set PDD_TESTBED_STATE to a folder of your own")
    return True


@dataclass
class ProcRecord:
    pid: int
    starttime: int | None
    name: str
    ns: str


@dataclass
class Run:
    """One live run: id, owner, and what it has created so far."""

    run_id: str
    owner_pid: int
    owner_starttime: int | None
    created: float
    namespaces: list[str] = field(default_factory=list)
    processes: list[ProcRecord] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return f"pdd{self.run_id}"

    @property
    def dir(self) -> Path:
        return STATE_ROOT / self.run_id

    def __post_init__(self) -> None:
        self._held: dict[str, int] = {}  # namespace -> fd with a shared flock (not saved)

    @classmethod
    def new(cls) -> Run:
        check_state_root(create=True)
        pid = os.getpid()
        run = cls(secrets.token_hex(3), pid, netns.proc_starttime(pid), time.time())
        os.mkdir(run.dir, ROOT_MODE)
        os.chmod(run.dir, ROOT_MODE)
        run.save()
        return run

    def folder_for(self, name: str, uid: int, gid: int, mode: int = 0o700) -> Path:
        """A folder of the run (0700) that belongs to ``uid``: what an unprivileged process
        writes. Files read back from it are read without following links. A folder that
        already exists (never a link) is given that owner and mode again."""
        path = self.dir / name
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return path

    def add_namespace(self, name: str) -> None:
        if not name.startswith(f"{self.prefix}-") or not NS_RE.fullmatch(name):
            raise ValueError(f"namespace name {name!r} is not of run {self.run_id}")
        self.namespaces.append(name)
        self.save()

    def hold(self, ns: str) -> None:
        """Hold a shared lock on a namespace of this run while the run lives."""
        if ns in self._held:
            return
        fd = os.open(netns.NETNS_DIR / ns, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self._held[ns] = fd

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def destroy(self) -> list[str]:
        """Release this run's locks, end its processes, remove its namespaces and folder."""
        self.release()
        removed = destroy(self.run_id, self.namespaces, self.processes)
        self.namespaces.clear()
        self.processes.clear()
        return removed

    def stop_applications(self) -> None:
        """End the run's processes other than its infrastructure (broker, delay line, Mininet
        shells), which stay up meanwhile: a worker in the far datacenter says goodbye to the
        broker across the WAN as it stops, and without the line it waits out its grace."""
        apps = sorted({p.pid for p in _alive(self.processes) if p.name not in INFRASTRUCTURE} - {os.getpid()})
        if apps:
            netns.terminate(apps)

    def stop_strays(self) -> None:
        """End every process left in the run's namespaces but its infrastructure: what an
        application forked and left behind (its grandchildren outlive ``stop_applications``)."""
        kept = {p.pid for p in _alive(self.processes) if p.name in INFRASTRUCTURE} | {os.getpid()}
        strays = sorted({pid for ns in self.namespaces for pid in netns.pids_in_namespace(ns)} - kept)
        if strays:
            netns.terminate(strays)

    def add_process(self, pid: int, name: str, ns: str) -> None:
        self.processes.append(ProcRecord(pid, netns.proc_starttime(pid), name, ns))
        self.save()

    def save(self) -> None:
        write_private(self.dir / "manifest.json", json.dumps(asdict(self), indent=1, default=str))

    @classmethod
    def load(cls, path: Path) -> Run:
        """A manifest, checked: the folder's run id, namespaces of that run, PIDs with start
        times. Raises ``ValueError`` (or ``OSError``) for anything else."""
        data = json.loads(read_nofollow(path))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a manifest")
        run_id = data.get("run_id")
        if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or run_id != path.parent.name:
            raise ValueError(f"{path}: run_id {run_id!r} is not this folder's")
        spaces = data.get("namespaces", [])
        if not isinstance(spaces, list) or not all(isinstance(n, str) and n.startswith(f"pdd{run_id}-")
                                                    and NS_RE.fullmatch(n) for n in spaces):
            raise ValueError(f"{path}: namespaces: not all of run {run_id}")
        procs = []
        for p in data.get("processes", []):
            if not (isinstance(p, dict) and set(p) == {"pid", "starttime", "name", "ns"}
                    and type(p["pid"]) is int and p["pid"] > 1
                    and (p["starttime"] is None or type(p["starttime"]) is int)
                    and isinstance(p["name"], str) and isinstance(p["ns"], str)):
                raise ValueError(f"{path}: processes: bad record {p!r}")
            procs.append(ProcRecord(**p))
        owner, since = data.get("owner_pid"), data.get("owner_starttime")
        if type(owner) is not int or owner <= 1 or not (since is None or type(since) is int):
            raise ValueError(f"{path}: owner_pid/owner_starttime: bad values")
        created, info = data.get("created"), data.get("info", {})
        if not isinstance(created, (int, float)) or not isinstance(info, dict):
            raise ValueError(f"{path}: created/info: bad values")
        return cls(run_id, owner, since, float(created), list(spaces), procs, info)

    def owner_alive(self) -> bool:
        return netns.is_alive(self.owner_pid, self.owner_starttime)


# The names of what the run's other processes talk to or run in, recorded by those who start
# them: stopped after the rest (``stop_applications``).
BROKER, DELAY_LINE, MININET_SHELL = "mosquitto", "delayline", "mininet shell"
INFRASTRUCTURE = {BROKER, DELAY_LINE, MININET_SHELL}


def destroy(run_id: str, namespaces: list[str], processes: list[ProcRecord]) -> list[str]:
    """Stop the run's processes and delete its namespaces. Returns what was removed."""
    if not RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    removed: list[str] = []
    prefix = f"pdd{run_id}-"
    # Those the caller names, and any other of the run's prefix that no live run holds: one a
    # live run holds (its manifest under another state root), or one made in the last seconds
    # (created, not yet locked: a run mid-build), is spared.
    found = {n for n in netns.list_namespaces() if n.startswith(prefix) and NS_RE.fullmatch(n)
             and n not in namespaces and not _held(n) and not _young(n)}
    all_ns = sorted(n for n in set(namespaces) | found if n.startswith(prefix) and NS_RE.fullmatch(n))
    victims = [p.pid for p in _alive(processes)]
    for ns in all_ns:
        victims += netns.pids_in_namespace(ns)
    victims = sorted(set(victims) - {os.getpid()})
    if victims:
        netns.terminate(victims)
        removed += [f"process {pid}" for pid in victims]
    for ns in all_ns:
        if (netns.NETNS_DIR / ns).exists():
            # Deleting the namespace destroys every link and qdisc inside it.
            with contextlib.suppress(OSError):
                netns.remove_namespace(ns)
            removed.append(f"namespace {ns}")
    remove_tree(STATE_ROOT / run_id)
    return removed


def _alive(processes: list[ProcRecord]) -> list[ProcRecord]:
    # Only a PID whose start time was recorded: a bare PID may name another process by now.
    return [p for p in processes if p.pid > 1 and p.starttime is not None and netns.is_alive(p.pid, p.starttime)]


def clean_stale(include_live: bool = False) -> list[str]:
    """Remove everything left by runs whose owner is dead (all runs if ``include_live``).

    Also removes testbed-prefixed namespaces with no manifest at all (a manifest is written
    before any namespace, so such a namespace can only come from a wiped state dir).
    """
    removed: list[str] = []
    known: set[str] = set()
    if check_state_root():
        for d in sorted(STATE_ROOT.iterdir()):
            if not RUN_ID_RE.fullmatch(d.name) or d.is_symlink():
                continue  # not a run's folder: not ours to judge
            mf = d / "manifest.json"
            try:
                run = Run.load(mf)
            except (OSError, ValueError, TypeError):
                # Manifest being written right now or unreadable: judge by age.
                if time.time() - d.stat().st_mtime < BUILD_GRACE_S:
                    known.add(d.name)
                    continue
                removed += destroy(d.name, [], [])
                continue
            known.add(run.run_id)
            if include_live or not run.owner_alive():
                removed += destroy(run.run_id, run.namespaces, run.processes)
    for ns in netns.list_namespaces():
        if NS_RE.fullmatch(ns) and ns[3:9] not in known and not _held(ns) and not _young(ns):
            removed += destroy(ns[3:9], [ns], [])
    return removed


def _young(ns: str) -> bool:
    """Whether namespace ``ns`` was made within ``BUILD_GRACE_S``: a run creates a namespace,
    then locks it; in between only its age says it is not an orphan."""
    try:
        return time.time() - os.lstat(netns.NETNS_DIR / ns).st_mtime < BUILD_GRACE_S
    except OSError:
        return False


def _held(ns: str) -> bool:
    """Whether a live run (of any state root) holds namespace ``ns``."""
    try:
        fd = os.open(netns.NETNS_DIR / ns, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def live_runs() -> list[Run]:
    runs = []
    if check_state_root():
        for d in sorted(STATE_ROOT.iterdir()):
            with contextlib.suppress(OSError, ValueError, TypeError):
                run = Run.load(d / "manifest.json")
                if run.owner_alive():
                    runs.append(run)
    return runs


def host_namespace(host: str, run_id: str | None = None) -> str:
    """The namespace of ``host`` (a scenario host, ``gw-<dc>`` or ``wan``) in the one live
    run that has it (or in ``run_id``). Raises ``LookupError`` saying what is running."""
    runs = [r for r in live_runs() if run_id is None or r.run_id == run_id]
    if not runs:
        raise LookupError(f"no live run{f' {run_id}' if run_id else ''} (start one: testbed net up, run, serve)")
    having = [r for r in runs if f"{r.prefix}-{host}" in r.namespaces]
    if len(having) == 1:
        return f"{having[0].prefix}-{host}"
    if not having:
        hosts = sorted({ns.removeprefix(f"{r.prefix}-") for r in runs for ns in r.namespaces})
        raise LookupError(f"no host {host!r} in the live run{'s' if len(runs) > 1 else ''} (hosts: {', '.join(hosts)})")
    raise LookupError(f"{len(having)} live runs have a host {host!r}: pick one with --run "
                      f"({', '.join(r.run_id for r in having)})")


def stop_runs(run_id: str | None = None) -> list[str]:
    """``testbed net down``: ask each live run's owner (or only ``run_id``'s) to stop, wait up
    to 10 s, then remove whatever is left. Returns the run ids stopped."""
    stopped = []
    for run in live_runs():
        if run_id and run.run_id != run_id:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.owner_pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while run.owner_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        destroy(run.run_id, run.namespaces, run.processes)
        stopped.append(run.run_id)
    return stopped
