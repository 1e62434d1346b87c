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


@dataclass
class RequestState:
    rid: str
    prompt_len: int
    max_new: int
    arrived: float
    meta: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    events: list[tuple[str, str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    pipeline: str  # label recorded with the request, e.g. "P-D(a)" or "P-D(b)"
    prefill: str
    decode: str


class Policy(ABC):
    name: str = "policy"

    @abstractmethod
    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        """Choose workers for a new request. Raise LookupError if none can serve it."""

    def on_event(self, req: RequestState, kind: str, data: dict[str, Any]) -> None:  # noqa: B027
        """React to a worker event for ``req`` (default: nothing)."""

    def describe(self) -> str:
        return self.name
