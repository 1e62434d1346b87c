"""``--dilation auto`` remembered per scenario, trace and host, and moved by each run's verdict.

Choosing a dilation costs a calibration or a few probe deployments, and a choice that a
full run then fails is worth learning from. So the choice is kept in a small JSON file per
(scenario file, trace file, token scale, requests replayed and how fast, host), under the cache folder
(``.cache/dilation``; ``PDD_TESTBED_DILATION_CACHE`` names another, ``off`` disables it). The
next ``auto`` run with the same inputs on the same host takes it without probing, and each
run at an ``auto`` dilation moves it (``failed_at``, ``passed_at``): a failed verdict raises
the kept value by ``FAILED_STEP`` for the next one, so five runs in a row do not fail the same
way, and marks that dilation as too low here; a passed one whose steps say they would have kept
up lower (``Verdict.need``) lowers it to that, times ``SAFETY``, never within ``FLOOR_STEP``
of a dilation that failed here. So the margin over the probe is taken from the verdicts of the
runs themselves, not fixed. An entry older than
``MAX_AGE_S``, from another version, or not what this module writes is ignored (and says
so): the file is read, not trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

from testbed.deploy.emulation import round_up
from testbed.errors import InputError
from testbed.outputs import open_folder, write_atomic
from workers.privilege import open_regular

CACHE_ENV = "PDD_TESTBED_DILATION_CACHE"
VERSION = 1
MAX_AGE_S = 14 * 86400.0  # a host's load and software change: re-probe every two weeks
FAILED_STEP = 1.5  # a failed verdict at D: the next auto run starts at 1.5 D
# A passed run's need to the next choice: a lower D runs the same work in less wall time and
# keeps the host busier than the run that measured the need.
SAFETY = 1.25
FLOOR_STEP = 1.25  # never again within this factor of a dilation that failed here
MAX_WHY = 1000
_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path | None:
    """Where choices are kept; None when disabled."""
    value = os.environ.get(CACHE_ENV, "")
    if value == "off":
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("PDD_TESTBED_CACHE", _ROOT / ".cache")) / "dilation"


def host_identity() -> str:
    """What makes one host keep up where another does not: its processor, cores, memory and kernel."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return f"{model}; {os.cpu_count()} cpus; {mem >> 30} GiB; {platform.release()}"


def _digest(path: Path | None) -> str:
    if path is None or not path.is_file():
        return "-"
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def key_for(scenario: Path | None, trace: Path | None, token_scale: int, shape: str) -> str:
    """The cache key of an auto choice: every input that moves it (``shape``: how many
    requests are replayed, how fast), hashed."""
    parts = [f"v{VERSION}", _digest(scenario), _digest(trace), str(token_scale), shape, host_identity()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _path(key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{key}.json"


def recall(key: str) -> tuple[float, str] | None:
    """The kept dilation and its reason, or None (nothing kept, or an entry not to be used)."""
    path = _path(key)
    if path is None or not path.exists():
        return None
    try:
        folder = open_folder(path.parent, create=False)  # root reads no entry another account could have written
    except (OSError, InputError) as e:
        print(f"dilation auto: ignoring {path}: {e}", flush=True)
        return None
    try:
        with os.fdopen(open_regular(path.name, dir_fd=folder), "rb") as f:
            data = json.loads(f.read(10_000))
        d, why, at, floor = data["dilation"], data["why"], data["at"], data.get("floor", 0.0)
        ok = (data.get("version") == VERSION and _dilation(d) and isinstance(why, str) and isinstance(at, int | float)
              and (floor == 0.0 or _dilation(floor)))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        ok = False
    finally:
        os.close(folder)
    if not ok:
        print(f"dilation auto: ignoring {path}: not a kept choice of this version", flush=True)
        return None
    if time.time() - at > MAX_AGE_S:
        print(f"dilation auto: the kept choice in {path} is older than {MAX_AGE_S / 86400:g} days: probing again",
              flush=True)
        return None
    _floors[key] = float(floor)
    return float(d), why[:MAX_WHY]


def _dilation(d: object) -> bool:
    return isinstance(d, int | float) and not isinstance(d, bool) and math.isfinite(d) and 0.1 <= d <= 1000


_floors: dict[str, float] = {}  # per key, the highest dilation that failed here (as last read or written)


def remember(key: str, dilation: float, why: str, floor: float = 0.0) -> None:
    """Keep a choice (atomically: a reader sees the old file or the new one); ``floor``: the
    highest dilation that failed here."""
    path = _path(key)
    _floors[key] = floor
    if path is None:
        return
    try:
        write_atomic(path, json.dumps({"version": VERSION, "dilation": dilation, "why": why[:MAX_WHY],
                                       "at": time.time(), "host": host_identity(), "floor": floor}) + "\n")
    except (OSError, InputError) as e:  # a cache: the run goes on without it
        print(f"dilation auto: the choice is not kept: {e}", flush=True)


def failed_at(key: str, dilation: float, need: float | None = None) -> float:
    """A run at the auto dilation ``dilation`` failed its verdict: keep ``FAILED_STEP`` times
    it (or its steps' need times ``SAFETY``, if more) for the next run, and remember that it
    failed; returns the value kept."""
    floor = max(_floors.get(key, 0.0), dilation)
    raised = round_up(max(dilation * FAILED_STEP, (need or 0.0) * SAFETY * dilation))
    remember(key, raised, f"auto: the last run at D {dilation:g} on this host failed its fidelity verdict; "
                          f"x {FAILED_STEP:g}", floor)
    return raised


def passed_at(key: str, dilation: float, need: float | None) -> float | None:
    """A run at the auto dilation ``dilation`` passed its verdict and its steps would have
    kept up at ``need`` x it (``Verdict.need``): keep ``need x SAFETY`` x it for the next run,
    but never within ``FLOOR_STEP`` of a dilation that failed here; returns the value kept, or
    None when that is no lower (the kept one stands)."""
    if need is None:
        return None
    floor = _floors.get(key, 0.0)
    lower = round_up(max(0.1, need * SAFETY * dilation, floor * FLOOR_STEP))
    if lower >= dilation:
        return None
    why = (f"auto: the last run at D {dilation:g} on this host passed its fidelity verdict, its steps needing "
           f"{need:.2f} x it; x {SAFETY:g}" + (f", above x {FLOOR_STEP:g} D {floor:g} (failed here)" if floor else ""))
    remember(key, lower, why, floor)
    return lower
