"""The policy interface and the request state it reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerView:
    name: str
    role: str
    dc: str
    host: str
    kv_port: int
    up: bool = False
    active: int = 0
    queued: int = 0
    assigned: int = 0  # requests the router has in flight on this worker (fresher than status)


@dataclass
class ClusterView:
    """What the router knows about the workers right now (from their status messages)."""

    workers: dict[str, WorkerView] = field(default_factory=dict)

    def pick(self, role: str, dc: str | None = None) -> WorkerView:
        """The least-loaded live worker of a role (optionally in one datacenter)."""
        cands = [w for w in self.workers.values() if w.role == role and w.up and (dc is None or w.dc == dc)]
        if not cands:
            where = f" in datacenter {dc}" if dc else ""
            raise LookupError(f"no live {role} worker{where}")
        return min(cands, key=lambda w: (w.assigned, w.active + w.queued, w.name))

    def pick_outside(self, role: str, dc: str) -> WorkerView:
        """The least-loaded live worker of a role in the first other datacenter that has one."""
        remote = sorted({w.dc for w in self.workers.values() if w.role == role and w.dc != dc and w.up})
        if not remote:
            raise LookupError(f"no live {role} worker outside datacenter {dc}")
        return self.pick(role, dc=remote[0])


@dataclass
class RequestState:
    rid: str
    prompt_len: int
    max_new: int
    arrived: float
    meta: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    events: list[tuple[str, str, float]] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    handed_off: bool = False  # a relay handed the stream to the main decoder


@dataclass(frozen=True)
class Plan:
    """Which workers serve a request. ``decode`` streams to the end; with ``relay`` set, the
    relay decoder streams first (eager tokens) and hands over to ``decode`` (PDD's
    P-RLD-MD). KV goes from ``prefill`` to the decoder(s) that need it."""

    pipeline: str  # label recorded with the request, e.g. "P-D(a)", "P-MD", "P-RLD-MD"
    prefill: str
    decode: str
    relay: str | None = None
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # why (recorded)

    @property
    def workers(self) -> set[str]:
        return {w for w in (self.prefill, self.decode, self.relay) if w}


@dataclass(frozen=True)
class PolicyContext:
    """Facts about the deployment a policy may need (from the scenario and the model)."""

    wan_rate_bps: float | None = None  # forward direction (prefill side -> other side)
    wan_rtt_s: float = 0.0
    kv_bytes_per_token: int = 0
    block_size: int = 16
    decode_cache_tokens: int = 0


class Policy(ABC):
    name: str = "policy"
    ctx: PolicyContext = PolicyContext()

    def bind(self, ctx: PolicyContext) -> None:
        """Called once by the router before the first request."""
        self.ctx = ctx

    @abstractmethod
    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        """Choose workers for a new request. Raise LookupError if none can serve it."""

    def decode_options(self, req: RequestState, plan: Plan, worker: str) -> dict[str, Any]:
        """Extra options of the decode command sent to ``worker`` (default: none)."""
        return {}

    def handoff_options(self, req: RequestState, cluster: ClusterView) -> dict[str, Any]:
        """How the relay hands over once the main decoder holds the KV (relay plans only)."""
        return {"mode": "one-shot"}

    def cut_off(self, req: RequestState) -> bool:
        """A relay finished ``req`` before the main decoder held its KV: cut the WAN transfer
        off (True) or let it complete into the main decoder's cache (False)?"""
        return True

    def on_event(self, req: RequestState, kind: str, worker: str, data: dict[str, Any]) -> None:  # noqa: B027
        """React to a worker event for ``req`` (default: nothing)."""

    def stats(self) -> dict[str, Any]:
        """Policy-level counters for the run's summary."""
        return {}

    def describe(self) -> str:
        return self.name
