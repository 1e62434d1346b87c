"""PDD: prefill (P) and relay decode (RLD) in the prefill's datacenter, main decode (MD) across
the WAN (``docs/design.md``).

Routing, per request, from what the MD lacks and what the WAN is doing:

* what the MD lacks = prompt tokens beyond its cached prefix (a shadow ``PrefixIndex`` of
  the prompts sent to it; with ``drc=off`` the MD caches nothing, so it lacks everything);
* how long that would wait = ``WanEstimator.wait_s`` (backlog of transfers in flight +
  this delta, at the configured rate corrected by what finished transfers achieved);
* **P-MD** when that wait is at most ``relay_s`` (a small delta: no relay needed);
  **P-RLD-MD** otherwise: KV goes to the RLD over the LAN and, in parallel, the missing
  part to the MD over the WAN; the RLD streams eager tokens and hands over by token IDs
  (``workers/handoff.py``) once the MD holds the KV;
* with ``filter=predict``, a request flagged ``short_output`` whose delta is at least
  ``low_hit`` of its prompt stays on the RLD alone (**P-RLD**): its WAN transfer would
  occupy the line for nothing. Counted in ``stats()``: doing this for every low-hit
  request would overload the RLD.

When the RLD finishes a request before the MD holds its KV, the WAN transfer is cut off
(bytes stop) and the MD's reservation freed (``cutoff=all``); with ``cutoff=anomalous`` (the
default) only if the request is the anomalous kind: low hit at P (it computed at least
``low_hit`` of the prompt: fresh content) or flagged ``short_output``. Otherwise the KV
still lands in the MD's cache, as the history a session's next turn will extend; cutting
those off would keep the MD's cache cold and push every later turn onto the RLD.
``cutoff=off`` never cuts.

Degraded service (faults, ``testbed.faults``): with no main decoder alive (dead, or cut off
by the WAN long enough for its broker session to lapse) a request goes **P-RLD** (counted as
``P-RLD (no main decoder)``); with no relay alive, **P-MD** (``P-MD (no relay)``). The
router's side of the same rule: a main decoder lost before the handoff leaves the relay to
finish alone (``control.router``).

Options (``pdd:key=value,...``, ``PddOptions`` below):
``handoff`` one-shot | catch-up | adaptive (one-shot while the RLD has at least ``load``
requests in flight, catch-up otherwise); ``threshold`` (catch-up batch, tokens, default
64); ``load`` (default 4); ``relay_s`` (default 0.5); ``drc`` on | off; ``filter`` off |
predict; ``low_hit`` (default 0.5); ``cutoff`` all | anomalous | off; ``transfer``
after-prefill | per-chunk (when the KV leaves the prefill; unset: the scenario's); ``eager`` (start the
handoff after exactly this many eager tokens, the relay holding there until the MD is
ready; for experiments and tests; a request's ``eager`` hint overrides it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.messages import DecodeCmd, Done, Event, Failed, HandoffCmd, KvReceived, KvSent, MainPart, RelayPart
from protocol.policy import PlanInfo
from protocol.worker_config import KvTransfer
from testbed.policies.base import (
    ClusterView,
    Plan,
    Policy,
    PolicyContext,
    PolicyReport,
    RequestState,
    connections_option,
    transfer_option,
)
from testbed.policies.prefix_index import PrefixIndex
from testbed.policies.registry import register
from testbed.policies.wan import WanEstimator

UNSHAPED_RATE_BPS = 10e9  # assumed line rate when the scenario leaves the WAN unshaped
OFF = {"tune": False}  # an option ``testbed tune`` leaves as given


class PddOptions(BaseModel):
    """PDD's options (the module docstring says what each one does); ``testbed tune`` searches
    the handoff, the relay's threshold, the batch, the load and the cut-off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    handoff: Literal["one-shot", "catch-up", "adaptive"] = "adaptive"
    threshold: int = Field(default=64, ge=1, description="catch-up batch, tokens",
                           json_schema_extra={"tune": {"low": 8, "high": 256, "log": True}})
    load: int = Field(default=4, ge=1, description="adaptive: one-shot at this many relay requests",
                      json_schema_extra={"tune": {"low": 1, "high": 16}})
    relay_s: float = Field(default=0.5, ge=0, description="relay when the WAN wait exceeds this",
                           json_schema_extra={"tune": {"low": 0.0, "high": 3.0}})
    drc: Literal["on", "off"] = Field(default="on", json_schema_extra=OFF)
    filter: Literal["off", "predict"] = Field(default="off", json_schema_extra=OFF)
    low_hit: float = Field(default=0.5, ge=0, le=1, description="share of the prompt computed = low hit",
                           json_schema_extra=OFF)
    cutoff: Literal["all", "anomalous", "off"] = "anomalous"
    eager: int | None = Field(default=None, ge=0, description="hand over after exactly this many tokens",
                              json_schema_extra=OFF)
    transfer: KvTransfer | None = transfer_option()
    connections: int | None = connections_option()


@register
class Pdd(Policy):
    name = "pdd"
    Options = PddOptions
    opts: PddOptions
    deploys = (("prefill", "home"), ("relay-decode", "home"), ("decode", "away"))
    crosses_wan = True

    def __init__(self, options: PddOptions | None = None) -> None:
        super().__init__(options)
        self.drc = self.opts.drc == "on"
        self.indexes: dict[str, PrefixIndex] = {}
        self.wan = WanEstimator(UNSHAPED_RATE_BPS)
        self.counts: Counter[str] = Counter()

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.indexes.values())

    def bind(self, ctx: PolicyContext) -> None:
        super().bind(ctx)
        self.wan = WanEstimator(ctx.wan_rate_bps or UNSHAPED_RATE_BPS, ctx.wan_rtt_s)

    # ----------------------------------------------------------------- routing
    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        plan = self._route(req, cluster)
        if self.opts.transfer is not None:
            plan = replace(plan, kv_transfer=self.opts.transfer)
        return plan if self.opts.connections is None else replace(plan, kv_connections=self.opts.connections)

    def _route(self, req: RequestState, cluster: ClusterView) -> Plan:
        o = self.opts
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        try:
            md = cluster.pick_outside("decode", p.dc, prompt=req.prompt)
        except LookupError:
            # No main decoder alive (dead, or cut off by the WAN): the relay serves alone.
            rld = cluster.pick("relay-decode", dc=p.dc)
            self.counts["P-RLD (no main decoder)"] += 1
            return Plan("P-RLD", p.name, rld.name)
        index = self.indexes.setdefault(md.name, PrefixIndex.shadowing(self.ctx, "decode"))
        have = index.match(req.prompt) if self.drc else 0
        delta = max(0, req.prompt_len - have)
        delta_bytes = self.ctx.transfer_bytes(delta)
        wait = self.wan.wait_s(delta_bytes) / self.ctx.dilation  # emulated seconds, as relay_s
        info = PlanInfo(md_have_tokens=have, delta_tokens=delta, delta_bytes=delta_bytes, est_wan_wait_s=wait,
                        wan_backlog_bytes=self.wan.backlog_bytes(), wan_efficiency=self.wan.efficiency)
        if o.filter == "predict" and req.hints.short_output and delta >= o.low_hit * req.prompt_len:
            rld = cluster.pick("relay-decode", dc=p.dc)
            self.counts["P-RLD (filtered)"] += 1
            return Plan("P-RLD", p.name, rld.name, info=info)
        self.wan.started(req.rid, delta_bytes)
        if wait > o.relay_s:
            try:
                rld = cluster.pick("relay-decode", dc=p.dc)
            except LookupError:  # no relay alive: the main decoder serves alone
                self.counts["P-MD (no relay)"] += 1
                return Plan("P-MD", p.name, md.name, info=info)
            self.counts["P-RLD-MD"] += 1
            return Plan("P-RLD-MD", p.name, md.name, relay=rld.name, info=info)
        self.counts["P-MD"] += 1
        return Plan("P-MD", p.name, md.name, info=info)

    def decode_command(self, req: RequestState, plan: Plan, worker: str) -> DecodeCmd:
        cmd = DecodeCmd(rid=req.rid, prompt=req.prompt.tolist(), max_new=req.max_new, drc=self.drc)
        if worker == plan.relay:
            budget = req.hints.eager if req.hints.eager is not None else self.opts.eager  # a trace may fix it
            return cmd.model_copy(update={"drc": True, "relay": RelayPart(main=plan.decode, eager_budget=budget)})
        if plan.relay:
            return cmd.model_copy(update={"main": MainPart(relay=plan.relay)})
        return cmd

    def handoff(self, req: RequestState, cluster: ClusterView) -> HandoffCmd:
        mode = self.opts.handoff
        if mode == "adaptive":
            assert req.plan is not None and req.plan.relay is not None
            busy = cluster.workers[req.plan.relay].assigned
            mode = "one-shot" if busy >= self.opts.load else "catch-up"
        self.counts[f"handoff {mode}"] += 1
        return HandoffCmd(rid=req.rid, mode=mode, batch=self.opts.threshold)

    def cut_off(self, req: RequestState) -> bool:
        if self.opts.cutoff != "anomalous":
            return self.opts.cutoff == "all"
        if not self.drc:
            return True  # no cache on the MD to keep the KV in
        prefill = req.prefill_done()
        computed = prefill.computed if prefill is not None else req.prompt_len
        fresh = computed >= self.opts.low_hit * req.prompt_len
        cut = bool(fresh or req.hints.short_output)
        self.counts["cut off" if cut else "kept for the MD cache"] += 1
        return cut

    def on_event(self, req: RequestState, event: Event) -> None:
        plan = req.plan
        if plan is None:
            return
        if isinstance(event, KvSent) and event.to == plan.decode:
            # From when it joined the sender's queue: the estimate counts the backlog ahead.
            # (A streamed transfer's time is its prefill's too: no sample of the line's rate.)
            observed = None if self.streamed(plan) else event.queued_s + event.end - event.start
            self.wan.finished(req.rid, observed, event.cancelled)
        elif (isinstance(event, KvReceived) and event.worker == plan.decode and self.drc
              and plan.pipeline != "P-RLD"):
            # Only now does the MD hold this prompt (a cut-off transfer never gets here).
            self.indexes[event.worker].insert(req.prompt)
        elif isinstance(event, Done) and event.worker == plan.relay and event.handed_off is False:
            self.counts["finished on RLD"] += 1
        elif isinstance(event, Failed):
            self.wan.inflight.pop(req.rid, None)

    def on_end(self, req: RequestState, error: str | None) -> None:
        # A request the router failed itself sends no event that would end its transfer's
        # entry; left there, its start would stay the oldest and the backlog read 0 from
        # then on. A completed request's entry ends with its (possibly late) KvSent.
        if error is not None:
            self.wan.inflight.pop(req.rid, None)

    def stats(self) -> PolicyReport:
        return PolicyReport(counts=dict(self.counts), wan_efficiency=self.wan.efficiency,
                            wan_samples=self.wan.samples, options=self.describe())
