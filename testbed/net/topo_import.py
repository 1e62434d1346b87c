"""Mininet topologies in: ``--topo FILE.py:ClassName`` turns a Mininet ``Topo`` subclass into
a validated scenario, so a topology written for Mininet runs on the testbed unchanged.

What the ``Topo`` must say (``topologies/two_dc_topo.py`` is the default scenario written
this way):

* one switch per datacenter (the datacenter is the switch's ``dc`` parameter, or its name);
* every host linked to exactly one switch, with a ``role`` parameter (``client``,
  ``router``, ``prefill``, ``decode``, ``relay-decode``) and optionally ``device``,
  ``devices`` and ``compute``, as a scenario's hosts have; a host link's ``bw`` (Mbit/s,
  as ``TCLink``'s) is the datacenter's LAN rate (one rate per datacenter);
* exactly one switch-to-switch link, the inter-datacenter bottleneck, with ``TCLink``'s
  parameters: ``bw`` (Mbit/s), ``delay`` and ``jitter`` (``"15ms"``, ``"500us"`` or a
  number of ms), ``loss`` (percent), ``max_queue_size`` (packets of 1,500 bytes, Mininet's
  Ethernet frames); ``params1`` / ``params2`` override them for the direction leaving the
  first / second switch, as they do for ``TCLink``.

Everything a ``Topo`` cannot say (models, devices, the emulation, workers, costs) comes
from the scenario the topology is applied to (``--scenario``, default ``two-dc.yaml``).
A topology that breaks a rule gets an error naming the node or link (exit 2).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from protocol.validation import first_error
from testbed.errors import InputError
from testbed.root_paths import import_file
from testbed.scenario import Host, Scenario

HOST_PARAMS = set(Host.model_fields)
LINK_PARAMS = {"bw", "delay", "jitter", "loss", "max_queue_size"}
MININET_FRAME = 1500  # bytes per packet of max_queue_size: Mininet's links carry Ethernet frames
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$")


def load_topo_class(spec: str) -> tuple[type, str]:
    """``FILE.py:ClassName`` -> the class (and the spec, for messages)."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name:
        raise InputError(f"--topo: expected FILE.py:ClassName, got {spec!r}")
    path = Path(path_s)
    if not path.is_file():
        raise InputError(f"--topo: {path}: no such file")
    try:
        from mininet.topo import Topo
    except ImportError as e:
        raise InputError(f"--topo: Mininet is not importable ({e}); make setup installs it") from e
    try:
        module = import_file(path.resolve(), "_pdd_topo_")  # executed: as root, only if no one else could write it
    except InputError as e:
        raise InputError(f"--topo: {e}") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Topo)):
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Topo) and v is not Topo)
        raise InputError(f"--topo: {path} has no Topo subclass {name!r} (found: {', '.join(found) or 'none'})")
    return cls, spec


def _ms(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _TIME.match(str(value))
    if not m:
        raise InputError(f"{where}: expected a time such as '15ms', '500us' or a number of ms, got {value!r}")
    n, unit = float(m.group(1)), m.group(2) or "ms"
    return n * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def _direction(params: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(params) - LINK_PARAMS)
    if unknown:
        raise InputError(f"{where}: unsupported link parameter {unknown[0]!r} "
                         f"(supported: {', '.join(sorted(LINK_PARAMS))})")
    out: dict[str, Any] = {"rate_mbit": params.get("bw"), "delay_ms": _ms(params.get("delay", 0), f"{where}: delay")}
    if "jitter" in params:
        out["jitter_ms"] = _ms(params["jitter"], f"{where}: jitter")
    if "loss" in params:
        out["loss_pct"] = params["loss"]
    if params.get("max_queue_size") is not None:
        out["queue_bytes"] = int(params["max_queue_size"]) * MININET_FRAME
    return out


def scenario_from_topo(topo: Any, base: Scenario, where: str) -> Scenario:
    """The scenario ``base`` with its datacenters and WAN taken from ``topo`` (a built Topo)."""
    switches = list(topo.switches(sort=False))
    dc_of = {s: str(topo.nodeInfo(s).get("dc", s)) for s in switches}
    hosts: dict[str, dict[str, Any]] = {h: {} for h in topo.hosts(sort=False)}
    attached: dict[str, list[str]] = {h: [] for h in hosts}
    lan: dict[str, set[float | None]] = {dc: set() for dc in dc_of.values()}
    wan_links: list[tuple[str, str, dict[str, Any]]] = []
    for a, b, info in topo.links(sort=False, withInfo=True):
        opts = {k: v for k, v in info.items() if k not in ("node1", "node2", "port1", "port2", "key")}
        if a in dc_of and b in dc_of:
            wan_links.append((a, b, opts))
        elif a in hosts and b in hosts:
            raise InputError(f"{where}: link {a}-{b} joins two hosts; a host links to its datacenter's switch")
        else:
            host, switch = (a, b) if a in hosts else (b, a)
            attached[host].append(switch)
            lan[dc_of[switch]].add(opts.get("bw"))
    if len(wan_links) != 1:
        named = ", ".join(f"{a}-{b}" for a, b, _ in wan_links) or "none"
        raise InputError(f"{where}: needs exactly one switch-to-switch link (the inter-datacenter bottleneck); "
                         f"found {len(wan_links)}: {named}")
    datacenters: dict[str, dict[str, Any]] = {dc: {"hosts": {}} for dc in dc_of.values()}
    for host in hosts:
        params = {k: v for k, v in topo.nodeInfo(host).items() if k in HOST_PARAMS}
        extra = sorted(set(topo.nodeInfo(host)) - HOST_PARAMS - {"ip", "mac", "cls", "defaultRoute"})
        if "role" not in params:
            raise InputError(f"{where}: host {host!r} has no role (addHost({host!r}, role=...): "
                             "client, router, prefill, decode or relay-decode)")
        if extra:
            raise InputError(f"{where}: host {host!r}: unsupported parameter {extra[0]!r} "
                             f"(supported: {', '.join(sorted(HOST_PARAMS))})")
        if len(attached[host]) != 1:
            raise InputError(f"{where}: host {host!r} is linked to {len(attached[host])} switches; it needs exactly "
                             "one (its datacenter's)")
        datacenters[dc_of[attached[host][0]]]["hosts"][host] = params
    for dc, rates in lan.items():
        if len(rates) > 1:
            raise InputError(f"{where}: the host links of datacenter {dc!r} have different bw "
                             f"({sorted(rates, key=str)}); one LAN rate per datacenter")
        datacenters[dc]["lan"] = {"rate_mbit": next(iter(rates), None)}
    a, b, opts = wan_links[0]
    link = f"{where}: link {a}-{b}"
    shared = {k: v for k, v in opts.items() if k not in ("params1", "params2")}
    wan = {"between": [dc_of[a], dc_of[b]],
           "forward": _direction({**shared, **opts.get("params1", {})}, link),
           "reverse": _direction({**shared, **opts.get("params2", {})}, link)}
    raw = base.model_dump(mode="json", exclude_none=False)
    raw.update(datacenters=datacenters, wan=wan)
    try:
        sc = Scenario.model_validate(raw)
    except ValidationError as e:
        raise InputError(f"{where}: {first_error(e, '(topology)')}") from None
    return sc.model_copy(update={"source": base.source})


def load_topo_scenario(spec: str, base: Scenario) -> Scenario:
    cls, where = load_topo_class(spec)
    try:
        topo = cls()
    except Exception as e:  # noqa: BLE001 - the user's class: say where it failed
        raise InputError(f"--topo {where}: building the Topo failed: {type(e).__name__}: {e}") from e
    return scenario_from_topo(topo, base, where)
