"""Shared fixtures. Root tests build real namespaces; each run has a unique prefix and is
torn down in a finally, so a failing test leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.analysis.results import SUMMARY_FILE, RunSummary
from testbed.analysis.wan_line import disagreements
from testbed.cli.main import main as testbed_main
from testbed.deploy.deployment import network_session
from testbed.deploy.fidelity import host_steal_s
from testbed.net import netns, runstate
from testbed.net.build import Network
from testbed.scenario import Scenario, deep_merge, load_scenario
from workers.privilege import Identity

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "topologies"
# Every test chooses its own dilation: none reuses an auto choice kept by an earlier run
# (tests/test_dilation_auto.py points the cache at a folder of its own). Subprocesses inherit it.
os.environ["PDD_TESTBED_DILATION_CACHE"] = "off"

ROOT_REASON = "needs root for network namespaces"
UNPRIVILEGED = Identity(pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("nobody").pw_gid)  # workers.run_as's default
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=ROOT_REASON)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After a test, every run it saved under its ``tmp_path``: no bin of KV on the WAN above
    what the line's rate and buffer allow, and on a lossless line the KV it counted sums to the
    table's (``testbed.analysis.wan_line.disagreements``): the suite's runs never plot the
    impossible."""
    result = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    for path in Path(tmp).rglob(SUMMARY_FILE) if tmp is not None else []:
        try:
            summary = RunSummary.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue  # a folder a test broke on purpose
        problems = disagreements(summary)
        assert not problems, f"{path.parent}: {problems[:3]}"
    return result


def status_of(pid: int) -> dict[str, str]:
    """/proc/PID/status as name -> value."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def assert_unprivileged(pid: int, who: Identity = UNPRIVILEGED) -> None:
    st = status_of(pid)
    uid, gid = who
    assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(gid)] * 4, (pid, st["Name"], st["Uid"])
    assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0
    assert st["NoNewPrivs"] == "1"


def host_state() -> tuple[set[str], set[str]]:
    """The host's namespaces and run folders now (``left_behind``'s ``before``)."""
    root = runstate.STATE_ROOT
    return set(netns.list_namespaces()), set(os.listdir(root)) if root.exists() else set()


def left_behind(before: tuple[set[str], set[str]]) -> set[str]:
    """Namespaces and run folders that appeared since ``before`` and belong to no live run: what
    a finished command left. A live run is another test's, running alongside under make test's
    parallel part; one caught while it writes its manifest is looked at again a second later."""
    for attempt in range(2):
        spaces, runs = host_state()
        live = {r.run_id for r in runstate.live_runs()}
        new = {n for n in spaces - before[0] if not any(n.startswith(f"pdd{r}-") for r in live)}
        new |= {f"{runstate.STATE_ROOT}/{r}" for r in runs - before[1] - live}
        if not new or attempt:
            return new
        time.sleep(1.0)
    return new


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``testbed ARGV`` in this process: the command line's parsing, errors and exit status,
    without a second interpreter's start-up and imports (1-3 s a call). Returns the exit
    status and what it wrote to stderr. One test per command still runs the real entry point."""
    code, _, err = run_cli_output(argv, capsys)
    return code, err


def run_cli_output(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``run_cli`` that also returns what the command printed: (status, stdout, stderr)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    capsys.readouterr()
    try:
        code = testbed_main(argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


_ungrouped: set[str] = set()


@pytest.hookimpl(trylast=True)  # after xdist's own: it checks what xdist did
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tiers: a test that needs root (namespaces, processes) is ``emulation``, any other
    ``unit`` (``make test-fast`` runs those alone); ``slow`` is set by hand on the tests that
    run a whole command end to end, and implies ``emulation``. An emulation test that failed
    while this virtual machine's hypervisor took its CPUs away is run again (twice at most).

    Under ``--dist loadgroup`` xdist marks a grouped test by suffixing its node id with the
    group; with a pytest where that suffix does not stick (9.2: pytest-xdist issue 1386) a group
    is spread over workers, each starting the module's shared fixture (two Ray clusters whose
    tests kill each other's replays): each such test fails, saying why, rather than run wrong."""
    if getattr(config.option, "loadgroup", False):
        _ungrouped.update(i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid)
        # A group is one long unit of work (the Ray cluster's tests: minutes): handed out first,
        # it runs beside the many short tests instead of after them (stable: order kept within).
        items.sort(key=lambda i: i.get_closest_marker("xdist_group") is None)
    for item in items:
        needs = any(m.kwargs.get("reason") == ROOT_REASON for m in item.iter_markers("skipif"))
        if needs or item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.emulation)
            item.add_marker(pytest.mark.flaky(reruns=2, condition=_host_was_taken))
        else:
            item.add_marker(pytest.mark.unit)


# ------------------------------------------------------------------ the host under the tests
# Emulation tests measure time on this machine: a run whose CPUs were handed to another guest
# for a moment (steal, in /proc/stat) fails its fidelity verdict or a measured delay for a
# reason outside the code. Steal is sampled through the session; a failed emulation test is
# run again when some second of its attempt lost more than STEAL_RERUN_S of CPU time (on 2
# CPUs a quiet host loses 0-0.07 s in any second, a busy neighbour 0.1-0.4 s), and every
# failure's report says how much was stolen.
STEAL_RERUN_S = 0.1
STEAL_PERIOD_S = 0.5
QUIET_WAIT_S = 60.0
_steal: deque[tuple[float, float]] = deque(maxlen=20000)  # (monotonic, steal CPU-s since boot)
_attempt_started = [0.0]


def _sample_steal() -> None:
    while True:
        _steal.append((time.monotonic(), host_steal_s()))
        time.sleep(STEAL_PERIOD_S)


def pytest_sessionstart(session: pytest.Session) -> None:
    threading.Thread(target=_sample_steal, name="steal-sampler", daemon=True).start()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in _ungrouped:
        pytest.fail("--dist loadgroup is not in effect with this pytest (the test kept no xdist group): "
                    "use the pytest pinned in pyproject.toml", pytrace=False)
    _attempt_started[0] = time.monotonic()


def steal_since(t0: float) -> tuple[float, float]:
    """CPU seconds stolen since ``t0`` in all, and in the worst second."""
    points = [(t, s) for t, s in list(_steal) if t >= t0 - STEAL_PERIOD_S]
    points.append((time.monotonic(), host_steal_s()))
    worst = 0.0
    for i, (t, s) in enumerate(points):
        j = next((k for k in range(i + 1, len(points)) if points[k][0] - t >= 1.0), None)
        if j is not None:
            worst = max(worst, (points[j][1] - s) / (points[j][0] - t))
    return points[-1][1] - points[0][1], worst


def _host_was_taken(error: BaseException | None = None) -> bool:
    """Rerun when the hypervisor took the CPUs during the attempt; first wait (a minute at
    most) for two quiet seconds in a row, or the rerun lands in the same burst (a clean-clone
    suite once saw one last through a test's three attempts)."""
    if steal_since(_attempt_started[0])[1] <= STEAL_RERUN_S:
        return False
    quiet, deadline = 0, time.monotonic() + QUIET_WAIT_S
    while quiet < 2 and time.monotonic() < deadline:
        before = host_steal_s()
        time.sleep(1.0)
        quiet = quiet + 1 if host_steal_s() - before <= STEAL_RERUN_S else 0
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and item.get_closest_marker("emulation") is not None:
        total, worst = steal_since(_attempt_started[0])
        report.sections.append(("host", f"this machine's hypervisor took {total:.2f} CPU-s during the attempt, "
                                        f"{worst:.2f} in its worst second (rerun above {STEAL_RERUN_S})"))
    return report


# Tests that are not about the WAN's rate run over a fast one, whatever the default scenario's
# calibration, so they take the same time if the default changes.
FAST_WAN = {"wan": {"forward": {"rate_mbit": 1000}, "reverse": {"rate_mbit": 1000}}}


def scenario_with(overrides: dict[str, Any] | None = None, base: str = "two-dc.yaml",
                  emulated: bool = False) -> Scenario:
    """The shipped scenario over a fast WAN. Unless ``emulated``, taken literally: no
    emulation, every host on the native device and unshaped LANs (tests that are not about
    pacing or the wire derivation run at the host's own speed)."""
    extra: dict[str, Any] = {}
    if not emulated:
        shipped = load_scenario(TOPOLOGIES / base)  # with what it extends
        extra = {"emulation": None,
                 "datacenters": {dc: {"lan": {"rate_mbit": None},
                                      "hosts": {h: {"device": "native"} for h in spec.hosts}}
                                 for dc, spec in shipped.datacenters.items()}}
    return load_scenario(TOPOLOGIES / base, deep_merge(deep_merge(FAST_WAN, extra), overrides or {}))


def small_wan(delay_ms: float, rate_mbit: float | None, jitter_ms: float = 0.0,
              loss_fwd: float = 0.0, queue_bytes: int | None = None) -> Scenario:
    """Two datacenters with one host each (plus a second in a) and the given WAN."""
    fwd: dict[str, Any] = {"rate_mbit": rate_mbit, "delay_ms": delay_ms, "jitter_ms": jitter_ms,
                           "loss_pct": loss_fwd, "queue_bytes": queue_bytes}
    rev: dict[str, Any] = {"rate_mbit": rate_mbit, "delay_ms": delay_ms, "jitter_ms": jitter_ms}
    return Scenario.model_validate({
        "name": "test-wan",
        "datacenters": {
            "a": {"hosts": {"ha": {"role": "client"}, "hb": {"role": "router"}}},
            "b": {"hosts": {"hc": {"role": "decode"}}},
        },
        "wan": {"between": ["a", "b"], "forward": fwd, "reverse": rev},
    })


@contextlib.contextmanager
def built(sc: Scenario, impairment: str = "auto") -> Iterator[Network]:
    """The CLI's own network session, plus a check that teardown left nothing behind."""
    prefix = ""
    try:
        with network_session(sc, impairment) as net:
            prefix = net.run.prefix
            yield net  # type: ignore[misc]
    finally:
        if prefix:
            assert not [n for n in netns.list_namespaces() if n.startswith(prefix)]
