"""What crosses between the orchestrator and the router process.

* ``RouterConfig``: built from the scenario in ``testbed.deploy.cluster``, written as JSON, and
  validated by ``python -m control CONFIG.json``. It embeds one ``BrokerInfo``, the
  parsed ``PolicySpec`` (never the policy string), the workers' endpoints and the
  ``PolicyContext``.
* ``RequestRecord``: one per request, written by the router as the request leaves its memory
  (JSON lines: all but the latest 4,096 while it runs, those when it stops) and read by
  ``testbed.analysis.metrics``: the plan, why it was chosen (``PlanInfo``), every worker
  event, and how the request ended.
* ``PolicyReport``: the policy's own counters, written next to the records.
* ``WorkerDeath``: each worker the router declared dead, appended next to the records as it
  happens.

``PolicySpec``, ``PolicyContext``, ``PlanInfo`` and ``PolicyReport`` are defined in
``protocol/policy.py`` and re-exported here.

Worker-side contracts (worker configuration and statistics) are in ``protocol/worker_config.py``,
the MQTT messages in ``protocol/messages.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protocol.messages import MAX_PROMPT_TOKENS, Event
from protocol.policy import Decision, PlanInfo, PolicyContext, PolicyReport, PolicySpec
from protocol.worker_config import BrokerInfo, Contract, RunAs, WorkerRole

__all__ = ["Decision", "PlanInfo", "PolicyContext", "PolicyReport", "PolicySpec", "RequestRecord", "RouterConfig",
           "WorkerDeath", "WorkerEndpoint"]


class WorkerEndpoint(Contract):
    role: WorkerRole
    dc: str
    host: str  # emulated IP address
    kv_port: int = Field(ge=1, le=65535)
    prefill_tflops: float | None = Field(default=None, gt=0)  # its device's peak x prefill efficiency; None: native


class RouterConfig(Contract):
    run_id: str
    broker: BrokerInfo
    policy: PolicySpec
    workers: dict[str, WorkerEndpoint]
    request_timeout_s: float = Field(default=600.0, gt=0)
    # Real seconds per emulated second: the router's own timers (settling a will, a broker
    # restart's grace, probing) are emulated times stretched by it, like every other.
    dilation: float = Field(default=1.0, gt=0)
    unreachable_grace_s: float = Field(default=30.0, ge=0)  # real seconds (scaled): unreachable, not yet dead
    cache_outputs: bool = False  # after a request, its prefill instance caches its answer (WarmCmd)
    failure_detection: Literal["probe", "none"] = "probe"  # control.liveness
    records_path: str  # in a folder ``run_as`` owns (with the policy report and deaths beside it)
    run_as: RunAs | None = None  # None: keep the privileges it started with
    context: PolicyContext = PolicyContext()
    # What a request may ask for (the router refuses the rest before any worker hears of it):
    # prompt and output within the model's context, every id within its vocabulary.
    trace_decisions: bool = False  # every plan with what it weighed, to ``<records>.decisions.jsonl``
    vocab_size: int = Field(default=2**31, ge=1)
    max_context: int = Field(default=MAX_PROMPT_TOKENS, ge=2, le=MAX_PROMPT_TOKENS)


class WorkerDeath(Contract):
    """A worker the router declared dead (``<records>.deaths.jsonl``, one per line)."""

    worker: str
    news_t: float  # wall clock: its "dead" status (last will) reached the router
    t: float  # wall clock: the router declared it dead and acted (no new requests, its requests ended)
    why: str


class RequestRecord(Contract):
    rid: str
    pipeline: str | None = None  # e.g. "P-D(a)", "P-MD", "P-RLD-MD", "P-RLD"; None: never planned
    prefill: str | None = None
    decode: str | None = None
    relay: str | None = None
    hold: list[str] = []  # decoders that took the KV into their caches only
    prefill_dc: str | None = None
    decode_dc: str | None = None
    dcs: dict[str, str] = {}  # the datacenter of each of its workers (what crossed the WAN)
    plan_info: PlanInfo = PlanInfo()
    md_failed: str | None = None  # the main decoder's failure the relay covered for
    cut_off: bool = False  # the WAN transfer was cut off (the relay finished first)
    error: str | None = None
    events: list[Event] = []  # in arrival order at the router (late events included)

    @property
    def workers(self) -> list[str]:
        """Every worker of its plan, in role order (prefill, main, lead, holders)."""
        return [w for w in (self.prefill, self.decode, self.relay, *self.hold) if w]


__all__ = ["Decision", "PlanInfo", "PolicyContext", "PolicyReport", "RequestRecord", "RouterConfig", "WorkerEndpoint"]
