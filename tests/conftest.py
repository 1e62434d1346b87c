"""Shared fixtures. Root tests build real namespaces; each run has a unique prefix and is
torn down in a finally, so a failing test leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.deploy.deployment import network_session
from testbed.net import netns
from testbed.net.build import Network
from testbed.scenario import Scenario, deep_merge, load_scenario

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "topologies"

ROOT_REASON = "needs root for network namespaces"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=ROOT_REASON)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers: a test that needs root (namespaces, processes) is ``emulation``, any other
    ``unit`` (``make test-fast`` runs those alone); ``slow`` is set by hand on the tests that
    run a whole command end to end, and implies ``emulation``."""
    for item in items:
        needs = any(m.kwargs.get("reason") == ROOT_REASON for m in item.iter_markers("skipif"))
        if needs or item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.emulation)
        else:
            item.add_marker(pytest.mark.unit)


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
        raw = yaml.safe_load((TOPOLOGIES / base).read_text())
        extra = {"emulation": None,
                 "datacenters": {dc: {"lan": {"rate_mbit": None},
                                      "hosts": {h: {"device": "native"} for h in spec["hosts"]}}
                                 for dc, spec in raw["datacenters"].items()}}
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
