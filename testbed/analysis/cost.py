"""What a policy's deployment costs: the scenario's ``costs`` applied to what it deploys.

A policy declares the roles it deploys and where (``Policy.deploys``: "home" = the
datacenter where requests enter, the router's; "away" = the other) and whether it needs the
inter-datacenter line (``Policy.crosses_wan``). Its hardware is every accelerator of every
host of those roles there (``Host.devices`` x the host's device profile), priced by
``costs.devices``, plus ``costs.wan_line`` when it crosses the WAN. On the report's
deployment (``topologies/paper.yaml``) that gives 88 GPU-A for same-dc and
43 GPU-A + 32 GPU-B + the line for PDD. Cost per output token divides the deployment's
price for the run's (emulated) duration by the emulated output tokens: prices are per
device-hour. Egress (``costs.wan_egress_per_gb``) is priced per GB of emulated KV that
crossed the line in the run, and added to the hardware's price for the run.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from testbed.policies import Policy
from testbed.scenario import Scenario


class HardwareCost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    unit: str
    devices: dict[str, int]  # device profile -> accelerators deployed
    wan_line: bool
    total: float  # price per hour of everything deployed

    def describe(self) -> str:
        parts = [f"{n} x {kind}" for kind, n in sorted(self.devices.items())]
        return " + ".join(parts + (["line"] if self.wan_line else [])) or "nothing"


def home_datacenters(sc: Scenario) -> set[str]:
    """Where requests enter: the router's datacenter."""
    return {dc for dc, d in sc.datacenters.items() if any(h.role == "router" for h in d.hosts.values())}


def missing_for(sc: Scenario, policy: type[Policy] | Policy) -> list[str]:
    """What the policy needs (``Policy.needs``) that the scenario lacks, in words."""
    home = home_datacenters(sc)
    have = {(h.role.value, "home" if dc in home else "away") for dc, d in sc.datacenters.items()
            for h in d.hosts.values()}
    return [f"a {role} instance {'in' if where == 'home' else 'outside'} datacenter {', '.join(sorted(home))}"
            for role, where in policy.needs if (role, where) not in have]


def hardware_cost(sc: Scenario, policy: type[Policy] | Policy) -> HardwareCost | None:
    """``None`` when the scenario states no prices."""
    if sc.costs is None:
        return None
    home = home_datacenters(sc)
    devices: dict[str, int] = {}
    for dc_name, dc in sc.datacenters.items():
        for host in dc.hosts.values():
            where = "home" if dc_name in home else "away"
            if (host.role.value, where) in policy.deploys and host.device in sc.devices:
                devices[host.device] = devices.get(host.device, 0) + host.devices
    total = sum(n * sc.costs.devices[k] for k, n in devices.items()) + (sc.costs.wan_line if policy.crosses_wan else 0)
    return HardwareCost(unit=sc.costs.unit, devices=devices, wan_line=policy.crosses_wan, total=total)


def cost_per_million_tokens(cost: HardwareCost, duration_s: float | None, output_tokens: int,
                            egress: float = 0.0) -> float | None:
    """The deployment's price for the run's duration (plus ``egress``, the run's WAN bytes
    priced) per million (emulated) output tokens."""
    if not duration_s or not output_tokens:
        return None
    return (cost.total * duration_s / 3600 + egress) / (output_tokens / 1e6)


def egress_price(sc: Scenario, wan_gb: float) -> float | None:
    """What ``wan_gb`` emulated GB over the line cost; ``None`` without prices."""
    return None if sc.costs is None else sc.costs.wan_egress_per_gb * wan_gb
