"""One unprivileged account and one folder per component of a run: what a part that was
taken over can touch.

The router, each worker role, ``serve``'s front end and the replay client (a process of
its own in an emulation) parse what arrives from the network,
so none keeps root (``workers.privilege``). Sharing one account, a compromised front end
could signal the router or rewrite the records root reads back as results. With
``workers.run_as: per-component`` (the default) each becomes a uid of its own, taken from the
range systemd keeps for dynamic users (61184-65519, no passwd entry, so nothing else on the
machine owns a file or runs a process under it): a block of ``BLOCK`` per run, recorded in
the run's manifest and taken under a lock so that two runs never share one, skipped while any
process still runs under one of its uids. Each component writes only ``out/<component>/``
(its uid's, 0700); the workers' folders are readable by the front end's group, whose
``/metrics`` shows their statistics (0640 files, the folder's group kept by setgid).

``workers.run_as: <account>`` makes every component that one account (the weaker, older
arrangement); ``root`` drops nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from protocol.worker_config import RunAs
from testbed.errors import BuildError
from testbed.net import runstate

PER_COMPONENT = "per-component"
DYNAMIC_FIRST, DYNAMIC_LAST = 61184, 65519  # systemd's dynamic users (systemd.exec, DynamicUser=)
BLOCK = 8
# Each one's place in its run's block: the worker roles, then the rest.
COMPONENTS = ("router", "prefill", "decode", "relay-decode", "colocated", "front", "client")
WORKER_FOLDERS = ("prefill", "decode", "relay-decode", "colocated")
OUT_DIR = "out"  # the run's folder (root's, 0711) holding one folder per component


def account(name: str) -> RunAs | None:
    """The unprivileged identity of account ``name`` (None for root: nothing to drop)."""
    pw = pwd.getpwnam(name)
    return None if pw.pw_uid == 0 else RunAs(uid=pw.pw_uid, gid=pw.pw_gid)


@dataclass(frozen=True)
class Accounts:
    """Each component's identity (None: it keeps root) and folder, for one run."""

    ids: dict[str, RunAs | None]
    out: Path  # the run's out/ folder

    def of(self, component: str) -> RunAs | None:
        return self.ids[component]

    def folder(self, component: str) -> Path:
        return self.out / component


def accounts_for(run: runstate.Run, run_as: str) -> Accounts:
    """The run's accounts for ``workers.run_as``, their folders made (owned and moded)."""
    if run_as == PER_COMPONENT:
        first = _take_block(run)
        ids: dict[str, RunAs | None] = {c: RunAs(uid=first + i, gid=first + i) for i, c in enumerate(COMPONENTS)}
    else:
        shared = account(run_as)
        ids = dict.fromkeys(COMPONENTS, shared)
    acc = Accounts(ids, run.folder_for(OUT_DIR, 0, 0, 0o711))
    front = ids["front"]
    for c in COMPONENTS:
        who = ids[c]
        uid = who.uid if who else 0
        if c in WORKER_FOLDERS:  # readable by the front end's group: its /metrics
            run.folder_for(f"{OUT_DIR}/{c}", uid, front.gid if front else 0, 0o2750)
        else:
            run.folder_for(f"{OUT_DIR}/{c}", uid, who.gid if who else 0)
    return acc


def _take_block(run: runstate.Run) -> int:
    """The first uid of a block no live run holds and no process runs under, recorded in
    ``run``'s manifest; under the state root's lock (a concurrent run takes another)."""
    fd = os.open(runstate.STATE_ROOT / "accounts.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held = {r.info.get("uids") for r in runstate.live_runs() if r.run_id != run.run_id}
        busy = _uids_running()
        n = (DYNAMIC_LAST - DYNAMIC_FIRST + 1) // BLOCK
        start = int(run.run_id, 16) % n
        for k in range(n):
            first = DYNAMIC_FIRST + (start + k) % n * BLOCK
            if first not in held and busy.isdisjoint(range(first, first + BLOCK)):
                run.info["uids"] = first
                run.save()
                return first
    finally:
        os.close(fd)
    raise BuildError(f"no free block of {BLOCK} uids in {DYNAMIC_FIRST}-{DYNAMIC_LAST} (every one is held by a "
                     "live run or used by a process): end a run, or set workers.run_as to an account")


def _uids_running() -> set[int]:
    """The real, effective, saved and file-system uids of every process."""
    uids: set[int] = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                for line in (d / "status").read_text().splitlines():
                    if line.startswith("Uid:"):
                        uids.update(int(u) for u in line.split()[1:])
                        break
    return uids


# What of root's environment a component gets: where programs and the testbed's caches are,
# the locale, the interpreter's own settings; no credential, token or proxy of root's shell.
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
            "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def component_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A component's environment: ``KEPT_ENV`` and the testbed's own ``PDD_TESTBED_*``."""
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("PDD_TESTBED_")}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    return {**env, **(extra or {})}
