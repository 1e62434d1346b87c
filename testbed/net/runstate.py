"""Run registry: every kernel object and process a run creates is recorded before it exists.

Each run gets an id and a name prefix (``pdd<6 hex>``) carried by all its namespaces. The
manifest (``<state root>/<id>/manifest.json``, in memory: see ``_state_root``) is written *before* the first namespace
is created and updated as processes start, so a crash at any point leaves enough behind for
``clean_stale`` to undo it: a run whose owner process is gone is stale. Processes are only
ever ended by PID (checked against their start time) or because they live inside one of
the run's own namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.net import netns


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

    @classmethod
    def new(cls) -> Run:
        pid = os.getpid()
        run = cls(secrets.token_hex(3), pid, netns.proc_starttime(pid), time.time())
        run.dir.mkdir(parents=True, exist_ok=False)
        run.save()
        return run

    def add_namespace(self, name: str) -> None:
        self.namespaces.append(name)
        self.save()

    def add_process(self, pid: int, name: str, ns: str) -> None:
        self.processes.append(ProcRecord(pid, netns.proc_starttime(pid), name, ns))
        self.save()

    def save(self) -> None:
        tmp = self.dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1, default=str))
        os.replace(tmp, self.dir / "manifest.json")

    @classmethod
    def load(cls, path: Path) -> Run:
        data = json.loads(path.read_text())
        data["processes"] = [ProcRecord(**p) for p in data.get("processes", [])]
        return cls(**data)

    def owner_alive(self) -> bool:
        return netns.is_alive(self.owner_pid, self.owner_starttime)


def destroy(run_id: str, namespaces: list[str], processes: list[ProcRecord]) -> list[str]:
    """Stop the run's processes and delete its namespaces. Returns what was removed."""
    removed: list[str] = []
    prefix = f"pdd{run_id}-"
    all_ns = sorted(set(namespaces) | {n for n in netns.list_namespaces() if n.startswith(prefix)})
    victims = [p.pid for p in processes if netns.is_alive(p.pid, p.starttime)]
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
    shutil.rmtree(STATE_ROOT / run_id, ignore_errors=True)
    return removed


def clean_stale(include_live: bool = False) -> list[str]:
    """Remove everything left by runs whose owner is dead (all runs if ``include_live``).

    Also removes testbed-prefixed namespaces with no manifest at all (a manifest is written
    before any namespace, so such a namespace can only come from a wiped state dir).
    """
    removed: list[str] = []
    known: set[str] = set()
    if STATE_ROOT.exists():
        for d in sorted(STATE_ROOT.iterdir()):
            mf = d / "manifest.json"
            try:
                run = Run.load(mf)
            except (OSError, ValueError, TypeError):
                # Manifest being written right now or unreadable: judge by age.
                if time.time() - d.stat().st_mtime < 5:
                    known.add(d.name)
                    continue
                removed += destroy(d.name, [], [])
                continue
            known.add(run.run_id)
            if include_live or not run.owner_alive():
                removed += destroy(run.run_id, run.namespaces, run.processes)
    for ns in netns.list_namespaces():
        if PREFIX_RE.match(ns) and ns[3:9] not in known:
            removed += destroy(ns[3:9], [ns], [])
    return removed


def live_runs() -> list[Run]:
    runs = []
    if STATE_ROOT.exists():
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
