"""An experiment's replays as tasks on a Ray cluster (``--executor ray``).

Each replay (one ``run_trace``: a sweep point, a draw, a sensitivity row) becomes one Ray task
whose inputs are the replay itself (scenario, trace, policies, options: what a local replay
gets) and, under ``--resume``, the files its folder already holds. The task replays into a
private folder on its node and returns every file it wrote; the driver writes them where a
local replay would have, each atomically, ``summary.json`` last, as replays come back. So run
folders, tables, plots and ``testbed report`` are those of ``--executor local``; a simulation's
files are byte for byte the same for the same inputs.

Placement keeps the emulation's fidelity: an emulation claims one ``testbed_host``, a custom
resource each node offers once (``ray start --resources '{"testbed_host": 1}'``), so no two
emulations share a host's cores, and it runs its own dilation probe and verdict there; a
simulation claims one CPU. A task whose worker or node dies is retried by Ray (``retries``,
default 2) and then recorded as failed, with Ray's reason, in the replay's folder
(``replay-failed.json``); the experiment says which points are missing. Ctrl-C cancels what is
still running (a task is interrupted as Ctrl-C interrupts a local replay: it tears down what it
built) and then runs ``testbed clean`` on every node.

Ray is an optional dependency (``pip install -e '.[cluster]'``): imported here only, and only
when asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testbed.deploy.dilation import emulation_plan
from testbed.engines import kind
from testbed.errors import CapabilityError, InputError, TestbedError
from testbed.experiments.trace_run import Replay, RunOptions, run_trace
from testbed.load.trace_replay import probe_replay
from testbed.net import runstate
from testbed.outputs import atomic_path
from testbed.scenario import Scenario
from testbed.traces.workload import Workload

HOST_RESOURCE = "testbed_host"  # offered once per node: one emulation per host at a time
FAILED_FILE = "replay-failed.json"
PLACEMENT_FILE = "replay.json"  # where and when it ran: node, start and end on the node's clock, exit
TASK_LOG = "replay.log"  # what the replay printed on its node (a local replay prints it here)
EXIT_TASK_FAILED = 1  # a replay that never came back: its requests count as not completed
CANCEL_GRACE_S = 60.0  # for interrupted tasks to tear down before they are killed
CONNECT_TIMEOUT_S = 10.0  # for the head's port to answer
MAX_FILE_BYTES = 256 << 20  # a file larger than this is not a replay's: refused, not written


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one task sends back: its exit status, the files of its run folder, where and how
    long it ran, and what it printed."""

    rc: int
    files: dict[str, bytes]
    node: str
    wall_s: float
    log: str
    started: float = 0.0  # the node's clock (Unix seconds): when the replay began and ended there
    ended: float = 0.0
    folder: str = ""  # where it wrote on the node (its log names this; the driver's copy names its own)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise CapabilityError("--executor ray: Ray is not installed here (pip install -e '.[cluster]', or "
                              "make setup CLUSTER=1; docs/scale-out.md)") from None
    return ray


def ray_address(given: str | None) -> str:
    address = given or os.environ.get("RAY_ADDRESS")
    if not address:
        raise InputError("--executor ray: name the cluster with --ray-address HOST:PORT or RAY_ADDRESS "
                         "(docs/scale-out.md: starting one)")
    return address


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` by its path relative to it (links are not followed)."""
    out: dict[str, bytes] = {}
    if not folder.is_dir():
        return out
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[p.relative_to(folder).as_posix()] = p.read_bytes()
    return out


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """The task's files into ``folder``, each through a temporary name in its own directory;
    ``summary.json`` last, so a folder with a summary holds the rest too. A path that would
    leave ``folder`` is refused (a node's answer is checked like any other input)."""
    root = folder.resolve()
    names = sorted(files, key=lambda n: (n == "summary.json", n))
    for name in names:
        data = files[name]
        target = (root / name).resolve()
        if root not in target.parents or name.startswith("/") or len(data) > MAX_FILE_BYTES:
            raise ValueError(f"a replay sent back {name!r}: not a file of its folder")
        with atomic_path(target) as tmp:
            tmp.write_bytes(data)


def replay_here(replay: Replay, kept: dict[str, bytes], node: str) -> Outcome:
    """One replay on this node (the body of the Ray task): into a private folder, seeded with
    what the driver's folder already held, and every file sent back."""
    t0, started = time.monotonic(), time.time()
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="testbed-replay-") as tmp:
        out = Path(tmp) / "run"
        out.mkdir()
        write_files(out, kept)
        opts = dataclasses.replace(replay.opts, out=out, executor="local", node=node)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            if kind(opts.engine).needs_root:
                runstate.clean_stale()  # what a killed earlier attempt on this host left
            try:
                rc = run_trace(replay.sc, replay.wl, replay.policies, opts)
            except TestbedError as e:
                print(f"error: {e}", file=sys.stderr)
                rc = e.exit_code
        files = {n: b for n, b in folder_files(out).items() if n not in kept or kept[n] != b}
    return Outcome(rc, files, node, time.monotonic() - t0, log.getvalue(), started, time.time(), str(out))


def _task(replay: Replay, kept: dict[str, bytes]) -> Outcome:
    import ray

    node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
    return replay_here(replay, kept, node)


def _dilation_task(sc: Scenario, wl: Workload, dilation: float | str | None) -> float:
    return emulation_plan(sc, wl, wl.specs(1.0), dilation, replay=probe_replay).dilation


def dilation_on_a_node(sc: Scenario, wl: Workload, opts: RunOptions) -> float:
    """The one dilation an experiment's emulations share, chosen (``auto``: probed) on a node
    of the cluster, holding its host as an emulation would: the driver may have no namespaces
    at all, and its cores are not the ones that will replay."""
    ray = _connect(opts)
    task = ray.remote(_dilation_task).options(num_cpus=0, resources={HOST_RESOURCE: 1}, max_retries=opts.ray_retries)
    try:
        return float(ray.get(task.remote(sc, wl, opts.dilation)))
    except ray.exceptions.RayError as e:
        raise TestbedError(f"--executor ray: choosing the dilation on a node failed: {_reason(e)}") from None


def _connect(opts: RunOptions) -> Any:
    ray = import_ray()
    if not ray.is_initialized():
        address = ray_address(opts.ray_address)
        _reachable(address)
        # The project is installed on every node (docs/scale-out.md): tasks import it there.
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    return ray


def _reachable(address: str) -> None:
    """A head that does not answer is an error now: ``ray.init`` would wait for it forever."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise CapabilityError(f"--executor ray: no Ray cluster answers at {address} ({e}); start one "
                              "(docs/scale-out.md) or name it with --ray-address") from None


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def _clean_task() -> list[str]:
    return runstate.clean_stale()


def _record_failure(folder: Path, why: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_files(folder, {FAILED_FILE: json.dumps({"failed": why}, indent=1).encode()})


def placement(opts: RunOptions) -> dict[str, Any]:
    """What a replay claims of a node: a simulation one core; an emulation the node's one
    ``testbed_host`` (no CPU count: it owns the host, however many cores it uses)."""
    return {"num_cpus": 1} if kind(opts.engine).parallel else {"num_cpus": 0, "resources": {HOST_RESOURCE: 1}}


def run_on_ray(replays: list[Replay]) -> list[int]:
    """Every replay as a Ray task on the cluster named by the first replay's options; each
    replay's exit status, in the order given (``EXIT_TASK_FAILED`` for one that never came
    back after its retries)."""
    ray = _connect(replays[0].opts)
    address = ray_address(replays[0].opts.ray_address)
    task = ray.remote(_task)
    refs: dict[Any, int] = {}
    rcs = [EXIT_TASK_FAILED] * len(replays)
    pending: list[Any] = []
    try:  # from the first submission: a Ctrl-C while sending cancels what was sent
        for i, r in enumerate(replays):
            assert r.opts.out is not None, "a replay sent to a cluster names its folder"
            kept = folder_files(r.opts.out) if r.opts.resume else {}
            kept.pop(FAILED_FILE, None)
            there = dataclasses.replace(r, opts=dataclasses.replace(r.opts, out=None))  # the node picks its folder
            ref = task.options(max_retries=r.opts.ray_retries, name=f"testbed replay {r.opts.out.name}",
                               **placement(r.opts)).remote(there, kept)
            refs[ref] = i
            pending.append(ref)
        print(f"ray: {len(replays)} replays sent to {address} "
              f"({sum(not kind(r.opts.engine).parallel for r in replays)} emulations, one per host)", flush=True)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = refs[ref]
                folder = replays[i].opts.out
                assert folder is not None
                try:
                    got: Outcome = ray.get(ref)
                except ray.exceptions.RayError as e:
                    why = _reason(e)
                    _record_failure(folder, why)
                    print(f"ray: {folder.name}: FAILED after {replays[i].opts.ray_retries} retries: {why}",
                          file=sys.stderr, flush=True)
                    continue
                (folder / FAILED_FILE).unlink(missing_ok=True)
                where = {"node": got.node, "started": got.started, "ended": got.ended, "wall_s": round(got.wall_s, 3),
                         "exit": got.rc}
                try:
                    log = got.log.replace(got.folder, str(folder)) if got.folder else got.log
                    write_files(folder, {**got.files, TASK_LOG: log.encode(),
                                         PLACEMENT_FILE: json.dumps(where, indent=1).encode()})
                except ValueError as e:  # a node's answer is checked like any input: this replay fails, not all
                    _record_failure(folder, f"{got.node}: {e}")
                    print(f"ray: {folder.name}: FAILED: {e}", file=sys.stderr, flush=True)
                    continue
                rcs[i] = got.rc
                print(f"ray: {folder.name}: exit {got.rc} on {got.node} in {got.wall_s:.1f} s "
                      f"({len(replays) - len(pending)}/{len(replays)})", flush=True)
    except KeyboardInterrupt:
        _cancel(ray, pending)
        raise
    return rcs


def _cancel(ray: Any, pending: list[Any]) -> None:
    """Interrupt what still runs (each tears down as a local replay does on Ctrl-C), kill what
    has not ended within the grace, then clean every live node of what a killed one left."""
    print(f"ray: interrupted; cancelling {len(pending)} replays and cleaning every node", file=sys.stderr, flush=True)
    for ref in pending:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    with contextlib.suppress(Exception):
        _, still = ray.wait(pending, num_returns=len(pending), timeout=CANCEL_GRACE_S) if pending else ([], [])
        for ref in still:
            ray.cancel(ref, force=True)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    clean = ray.remote(_clean_task)
    cleans = [clean.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
              .remote() for n in ray.nodes() if n.get("Alive")]
    with contextlib.suppress(Exception):
        ray.wait(cleans, num_returns=len(cleans), timeout=CANCEL_GRACE_S)

