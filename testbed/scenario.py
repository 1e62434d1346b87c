"""Scenario description: the validated, immutable picture of an experiment.

A scenario is read from YAML once, at the edge (``load_scenario``), and validated with
pydantic. Everything downstream (network build, workers, policies) receives the
``Scenario`` object and never re-reads YAML. Errors name the file, the line and the field.

This module only *describes*; ``testbed.net.plan`` turns a scenario into names and
addresses, and ``testbed.net.build`` instantiates it (Mininet's Topo vs Mininet split).
"""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from protocol.validation import field_errors
from protocol.worker_config import DeviceSpec
from testbed.errors import InputError
from testbed.faults.timeline import Fault, as_fault
from testbed.faults.wan_trace import WanTrace, as_wan_trace, faults_of
from testbed.hardware import DeviceProfile, ModelCard
from testbed.scenario_workers import Strict as _Strict
from testbed.scenario_workers import WorkerSettings
from testbed.scenario_yaml import deep_merge, extended, line_of, read_yaml, with_card_files
from testbed.traces.workload import VOCAB_HIGH
from workers.model_dir import default_model_dir, read_config

NAME_RE = r"^[a-z][a-z0-9]{0,11}(-[a-z0-9]{1,11})*$"
HostName = Annotated[str, Field(pattern=NAME_RE, max_length=16)]
DcName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9]{0,7}$")]


class Role(StrEnum):
    CLIENT = "client"
    ROUTER = "router"
    PREFILL = "prefill"
    RELAY_DECODE = "relay-decode"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefills and decodes (no disaggregation)


class Host(_Strict):
    role: Role
    device: str = Field(default="native", description="a key of `devices`, or native (no pacing)")
    devices: int = Field(default=1, ge=1, le=64, description=(
        "accelerators in this instance (tensor parallel): peak FLOP/s and bandwidth scale with it, the "
        "per-pass overhead does not, and each layer adds two all-reduces (testbed/hardware.py)"))
    compute: Literal["real", "modeled"] = Field(
        default="real", description="real: the small model computes every token; modeled: no forward pass, "
                                    "deterministic tokens, KV of the real size, paced by the device (cluster scale)")


class Costs(_Strict):
    """Hardware prices in one unit (say, GPU-A hours): per accelerator of each device profile
    and for the inter-datacenter line. A policy's cost is what it deploys (see
    ``testbed/analysis/cost.py``); nothing else in a run depends on these numbers."""

    unit: str = Field(default="cost units", min_length=1)
    devices: dict[str, float] = Field(description="price of one accelerator, per device profile")
    wan_line: float = Field(default=0.0, ge=0, description="price of the inter-datacenter line")
    wan_egress_per_gb: float = Field(default=0.0, ge=0, description=(
        "price of one GB (1e9 bytes) of emulated KV sent over the inter-datacenter line, either direction"))

    @field_validator("devices")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, x in v.items() if x < 0]
        if bad:
            raise ValueError(f"price of {bad[0]!r} must be >= 0")
        return v


class Emulation(_Strict):
    """What the testbed emulates: the model, and how emulated time maps to real time."""

    model: str = Field(description="a key of `models`")
    kv_of: str | None = Field(default=None, description="a key of `models` whose KV and state cross the line "
                              "in place of the model's, compute unchanged (a what-if); null: the model's own")
    time_dilation: float | Literal["auto"] = Field(default="auto", description="real s per emulated s, or auto")

    @field_validator("time_dilation")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if isinstance(v, float | int) and not 0.1 <= v <= 1000:
            raise ValueError("time_dilation must be between 0.1 and 1000, or auto")
        return v


class Lan(_Strict):
    """Links inside a datacenter (host <-> datacenter gateway), RDMA-class by default."""

    rate_mbit: float | None = Field(default=None, gt=0, description="per-host link rate; null = unshaped")


class Datacenter(_Strict):
    lan: Lan = Lan()
    hosts: dict[HostName, Host] = Field(min_length=1)


class WanDirection(_Strict):
    """One direction of the inter-datacenter line."""

    rate_mbit: float | None = Field(default=None, gt=0, description="null = unshaped")
    delay_ms: float = Field(ge=0, le=10_000)
    jitter_ms: float = Field(default=0.0, ge=0)
    loss_pct: float = Field(default=0.0, ge=0, lt=100)
    queue_bytes: int | None = Field(
        default=None, gt=0, description="bottleneck buffer; null = sized from rate x RTT"
    )
    trace: Annotated[WanTrace | None, BeforeValidator(as_wan_trace)] = Field(default=None, description=(
        "a link trace this direction replays in emulated time (testbed/faults/wan_trace.py: CSV t_s,rate_mbit"
        "[,delay_ms[,loss_pct]] or Mahimahi); a path from where the command runs"))

    @model_validator(mode="after")
    def _jitter_within_delay(self) -> WanDirection:
        if self.jitter_ms > self.delay_ms:
            raise ValueError("jitter_ms must not exceed delay_ms (a delay cannot be negative)")
        return self


class Wan(_Strict):
    between: tuple[DcName, DcName]
    forward: WanDirection = Field(description="first datacenter of `between` -> second")
    reverse: WanDirection = Field(description="second -> first")


class NetworkSettings(_Strict):
    subnet: ipaddress.IPv4Network = ipaddress.IPv4Network("10.213.0.0/16")
    # The emulated network is internal: a large MTU is a free 4x for the userspace delay line.
    mtu: int = Field(default=65000, ge=1280, le=65520)
    # The WAN's own MTU (null = mtu). A scaled-down line must still hold >= 64 frames in
    # flight to behave like a long fat pipe; with an emulation the testbed picks it
    # (hosts learn it by path-MTU discovery from their gateway).
    wan_mtu: int | None = Field(default=None, ge=1280, le=65520)
    # Who creates namespaces, links and bridges (testbed/net/nodes.py); shaping is ours on both.
    backend: Literal["pyroute2", "mininet"] = "pyroute2"

    @field_validator("subnet")
    @classmethod
    def _private_and_big_enough(cls, v: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
        if not v.is_private:
            raise ValueError(f"{v} is not a private range")
        if v.prefixlen > 16:
            raise ValueError("subnet must be /16 or larger (one /24 per datacenter)")
        return v


class Scenario(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    network: NetworkSettings = NetworkSettings()
    datacenters: dict[DcName, Datacenter] = Field(min_length=2, max_length=2)
    wan: Wan
    workers: WorkerSettings = WorkerSettings()
    devices: dict[str, DeviceProfile] = {}
    models: dict[str, ModelCard] = {}
    emulation: Emulation | None = Field(default=None, description="null: rates and times are taken as given")
    costs: Costs | None = Field(default=None, description="hardware prices (cost per output token, cost table)")
    faults: list[Annotated[Fault, BeforeValidator(as_fault)]] = Field(
        default=[], description="fault timeline applied in every run (testbed.faults.timeline), e.g. wan-down@20+5")
    policies: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        default=[], max_length=64, description="what runs compare when --policies is not given: each name[:k=v,...] "
                                               "or FILE.py:Class[:k=v,...] (a file relative to this one)")
    source: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        seen: dict[str, str] = {}
        for dc_name, dc in self.datacenters.items():
            for host in dc.hosts:
                if host in seen:
                    raise ValueError(f"host {host!r} appears in datacenters {seen[host]!r} and {dc_name!r}")
                if host.startswith("gw") or host == "wan":
                    raise ValueError(f"host name {host!r} is reserved")
                seen[host] = dc_name
            if self.network.backend == "mininet" and len(f"gw-{dc_name}-eth{len(dc.hosts)}") > 15:
                raise ValueError(f"datacenter {dc_name!r}: with the Mininet backend its gateway's ports are "
                                 f"gw-{dc_name}-eth<N>, longer than an interface name may be (15)")
        for dc in self.datacenters.values():
            for host, spec in dc.hosts.items():
                if spec.device != "native" and spec.device not in self.devices:
                    raise ValueError(f"host {host!r} uses unknown device profile {spec.device!r}")
        for dc in self.datacenters.values():
            for host, spec in dc.hosts.items():
                if spec.compute == "modeled" and (self.emulation is None or spec.device == "native"):
                    raise ValueError(f"host {host!r}: compute: modeled needs an emulation and a device profile "
                                     "(a modeled step lasts only as long as the emulated device takes)")
        if self.costs is not None:
            unknown = sorted(set(self.costs.devices) - set(self.devices))
            if unknown:
                raise ValueError(f"costs.devices names unknown device profile {unknown[0]!r}")
            used = {h.device for dc in self.datacenters.values() for h in dc.hosts.values() if h.device != "native"}
            unpriced = sorted(used - set(self.costs.devices))
            if unpriced:
                raise ValueError(f"costs.devices has no price for device profile {unpriced[0]!r}")
        try:
            faults_of(self.wan_directions())
        except InputError as e:
            raise ValueError(str(e)) from None
        for i, fault in enumerate(self.faults):
            try:
                self.check_fault(fault)
            except ValueError as e:
                raise ValueError(f"faults[{i}] {fault.label}: {e}") from None
        for name, dev in self.devices.items():
            if dev.fitted_to is not None and dev.fitted_to.model not in self.models:
                raise ValueError(f"devices.{name}.fitted_to.model names unknown model {dev.fitted_to.model!r}")
        for key, name in (self.emulation.model_dump(include={"model", "kv_of"}) if self.emulation else {}).items():
            if name is not None and name not in self.models:
                raise ValueError(f"emulation.{key} names unknown model {name!r}")
        a, b = self.wan.between
        for dc in (a, b):
            if dc not in self.datacenters:
                raise ValueError(f"wan.between names unknown datacenter {dc!r}")
        if a == b:
            raise ValueError("wan.between must name two different datacenters")
        return self

    def check_fault(self, fault: Fault) -> None:
        """A fault names this scenario's datacenters, hosts of components and shaped
        directions (ValueError otherwise)."""
        components = {h: str(spec.role) for dc in self.datacenters.values() for h, spec in dc.hosts.items()}
        a, b = self.wan.between
        unshaped = {name for name, d in ((f"{a}->{b}", self.wan.forward), (f"{b}->{a}", self.wan.reverse))
                    if d.rate_mbit is None}
        fault.check_against(list(self.datacenters), components, unshaped)

    def resolved_policies(self) -> list[str]:
        """``policies`` with a plugin's relative file made relative to this scenario's folder."""
        base = self.source.parent if self.source is not None else Path(".")
        out = []
        for text in self.policies:
            head, sep, rest = text.partition(":")
            if sep and head.endswith(".py") and not Path(head).is_absolute():
                text = f"{base / head}:{rest}"
            out.append(text)
        return out

    def wan_directions(self) -> dict[str, WanDirection]:
        """The line's two directions by name (``a->b``, ``b->a``)."""
        a, b = self.wan.between
        return {f"{a}->{b}": self.wan.forward, f"{b}->{a}": self.wan.reverse}

    def with_prefill_cost(self, factor: float) -> Scenario:
        """This scenario with every prefill (and extend) pass costing ``factor`` times the
        FLOPs it does: each device profile's ``compute_efficiency`` divided by ``factor``,
        its decode passes as they were. The report does not say what its prefill costs per
        token (a larger model of the same ~50 KB of KV per token, a less efficient engine) nor
        how its baseline splits its 88 accelerators between prefill and decode; to a
        compute-bound prefill's queue both look alike: fewer prefill accelerators or a
        costlier token. ``testbed calibrate --fit load,prefill`` fits it (docs/design.md)."""
        if factor == 1.0:
            return self
        if not 0 < factor <= 1000:
            raise ValueError(f"--prefill-cost: expected a factor in (0, 1000], got {factor:g}")
        devices = {}
        for name, d in self.devices.items():
            if d.compute_efficiency / factor > 1:
                raise ValueError(f"--prefill-cost {factor:g}: device profile {name!r} would exceed its peak")
            devices[name] = d.model_copy(update={
                "compute_efficiency": d.compute_efficiency / factor,
                "decode_compute_efficiency": d.decode_compute_efficiency or d.compute_efficiency})
        return self.model_copy(update={"devices": devices})

    # Convenience lookups used by the network plan and the router.
    def datacenter_of(self, host: str) -> str:
        for dc_name, dc in self.datacenters.items():
            if host in dc.hosts:
                return dc_name
        raise KeyError(host)

    def host(self, name: str) -> Host:
        return self.datacenters[self.datacenter_of(name)].hosts[name]

    def device_spec(self, host: str) -> DeviceSpec:
        """The roofline ``host``'s worker is paced to: its device profile for its device
        count, or native."""
        spec = self.host(host)
        dev = self.devices.get(spec.device)
        if dev is None:
            return DeviceSpec(name=spec.device)
        return dev.spec(spec.device, spec.devices)

    def hosts_with_role(self, role: Role) -> list[str]:
        return [h for dc in self.datacenters.values() for h, spec in dc.hosts.items() if spec.role == role]

    def model_dir(self) -> str:
        """The small real model the workers run: ``workers.model`` (validated), or where the
        default one lives (``testbed.deploy.model_files.ensure_model`` creates it before use; a
        description builds nothing)."""
        if not self.workers.model:
            return str(default_model_dir())
        path = self.workers.model
        where = f"{self.source}: " if self.source else ""
        if not (path / "config.json").is_file():
            raise InputError(f"{where}workers.model: {path} is not a model directory (no config.json)")
        try:
            vocab = read_config(path).vocab_size  # checked as every reader of the model's sizes has it
        except ValueError as e:
            raise InputError(f"{where}workers.model: {e}") from e
        if vocab < VOCAB_HIGH:
            raise InputError(f"{where}workers.model: {path} has a vocabulary of {vocab} tokens; traces are "
                             f"synthesised from token ids below {VOCAB_HIGH}")
        return str(path)

    def wan_direction(self, src_dc: str, dst_dc: str) -> WanDirection:
        a, b = self.wan.between
        if (src_dc, dst_dc) == (a, b):
            return self.wan.forward
        if (src_dc, dst_dc) == (b, a):
            return self.wan.reverse
        raise KeyError((src_dc, dst_dc))


def load_scenario(path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario file (``extends: FILE``: on top of that one, mappings merged
    key by key, the rest replaced). Raises InputError naming file:line: field."""
    path = Path(path)
    node, data = read_yaml(path)
    data = extended(path, data, (path.resolve(),))
    if overrides:
        data = deep_merge(data, overrides)
    data = with_card_files(path, data, ModelCard)
    try:
        return Scenario.model_validate({**data, "source": path})
    except ValidationError as e:
        raise InputError("\n".join(f"{path}:{line_of(node, err.loc) or '?'}: {err.field or '(top level)'}: {err.msg}"
                                   for err in field_errors(e))) from e
