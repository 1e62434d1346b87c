"""Prefill offload: PDD's split turned around. Decode stays where requests enter (a PD cluster
in the home datacenter); a long, uncached prefill moves to a compute pool in the other
datacenter, and its KV crosses the line back to the local decoder (Prefill-as-a-Service,
Moonshot and Tsinghua, 2026).

Per request, from what the local prefill would have to compute and what the line is doing:

* uncached = prompt tokens beyond the local prefill instance's cached prefix (a shadow
  ``PrefixIndex`` of the prompts sent to it), in emulated tokens;
* **P(away)-D**: uncached >= ``threshold`` and the line would carry the KV the local decoder
  lacks within ``wan_s`` (``WanEstimator``, the backlog of transfers in flight, as PDD's
  routing): the remote pool prefills (its own cache may hold the session's prefix from an
  earlier offloaded turn) and ships the KV to the local decoder;
* **P-D(home)** otherwise: prefill and decode in the home datacenter, as same-dc. A busy
  line keeps a request home (counted as ``local (line busy)``); so does a pool away that is
  busier than the home prefill (``local (away busier)``: requests in flight on each, with
  ``balance``; without it a fast line sends every long prefill away and its queue, not the
  line, becomes the tail), and a dead or unreachable remote pool (``local (no remote
  prefill)``);
* **every prefill away** in a deployment with no prefill instance where requests enter
  (``offloaded (no prefill home)``: PrfaaS's naive heterogeneous PD, ``topologies/prfaas-naive.yaml``).

Options (``prefill-offload:key=value,...``, ``OffloadOptions`` below): ``threshold``
(uncached emulated tokens, default 19,456: PrfaaS's reported break-even of ~19.4K, a starting
point that ``testbed tune`` can move), ``wan_s`` (default 2.0 emulated s), ``balance``
(default true: requests in flight, per unit of prefill compute between unlike devices, an
H200 pool beside H20 instances: counted alike it kept long prefills on the slow side;
docs/results.md) and ``transfer`` (``per-chunk``: an offloaded prefill's KV
streams back as it is computed, as PrfaaS pipelines it; unset: the scenario's
``kv_transfer``). A streamed transfer's time is its prefill's as much as the line's: it feeds
the line's backlog, never its learned efficiency.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from protocol.messages import DecodeCmd, Event, Failed, KvReceived, KvSent
from protocol.policy import PlanInfo
from protocol.worker_config import KvTransfer
from testbed.policies.base import (
    ClusterView,
    Plan,
    Policy,
    PolicyContext,
    PolicyReport,
    RequestState,
    WorkerView,
    busy,
    connections_option,
    transfer_option,
)
from testbed.policies.prefix_index import PrefixIndex
from testbed.policies.registry import register
from testbed.policies.wan import WanEstimator

UNSHAPED_RATE_BPS = 10e9  # assumed line rate when the scenario leaves the WAN unshaped


class OffloadOptions(BaseModel):
    """Prefill offload's options (the module docstring says what each one does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: int = Field(default=19456, ge=0, description="offload from this many uncached emulated tokens",
                           json_schema_extra={"tune": {"low": 0, "high": 65536, "step": 1024}})
    wan_s: float = Field(default=2.0, ge=0, description="offload only while the line carries the KV within this",
                         json_schema_extra={"tune": {"low": 0.0, "high": 5.0}})
    balance: bool = Field(default=True, description="offload only while the pool away is no busier than home")
    transfer: KvTransfer | None = transfer_option()
    connections: int | None = connections_option()


def _busier(away: WorkerView, home: WorkerView) -> bool:
    """``away`` has more in flight than ``home``: counted in requests between like devices, in
    requests per unit of prefill compute between unlike ones (an 8-H200 pool finishes a prefill
    ~8x sooner than an 8-H20 instance: by count it would look busier while it waits less)."""
    a, h = away.tflops, home.tflops
    if a and h and a != h:
        return tuple(x / a for x in busy(away)) > tuple(x / h for x in busy(home))
    return busy(away) > busy(home)


@register
class PrefillOffload(Policy):
    name = "prefill-offload"
    Options = OffloadOptions
    opts: OffloadOptions
    deploys = (("prefill", "home"), ("decode", "home"), ("prefill", "away"))
    crosses_wan = True
    needs = (("prefill", "away"),)

    def __init__(self, options: OffloadOptions | None = None) -> None:
        super().__init__(options)
        self.indexes: dict[str, PrefixIndex] = {}
        self.wan = WanEstimator(UNSHAPED_RATE_BPS)
        self.counts: Counter[str] = Counter()

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.indexes.values())

    def bind(self, ctx: PolicyContext) -> None:
        super().bind(ctx)
        # The KV of an offloaded prefill comes back: the line's reverse direction.
        self.wan = WanEstimator(ctx.wan_back_rate_bps or UNSHAPED_RATE_BPS, ctx.wan_rtt_s)

    def _index(self, worker: str, role: str = "decode") -> PrefixIndex:
        if worker not in self.indexes:
            self.indexes[worker] = PrefixIndex.shadowing(self.ctx, role)
        return self.indexes[worker]

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        home = self.ctx.home_dc
        if not any(w.role == "prefill" and w.dc == home for w in cluster.workers.values()):
            return self._everything_away(req, cluster)
        p = cluster.pick("prefill", dc=home, prompt=req.prompt)
        d = cluster.pick("decode", dc=p.dc, prompt=req.prompt)
        uncached = (req.prompt_len - self._index(p.name, "prefill").match(req.prompt)) * self.ctx.token_scale
        if uncached >= self.opts.threshold:
            try:
                r = cluster.pick_outside("prefill", p.dc, prompt=req.prompt)
            except LookupError:
                r = None
                self.counts["local (no remote prefill)"] += 1
            if r is not None and self.opts.balance and _busier(r, p):
                r = None
                self.counts["local (away busier)"] += 1
            if r is not None:
                have = self._index(d.name).match(req.prompt)
                delta = max(0, req.prompt_len - have)
                delta_bytes = self.ctx.transfer_bytes(delta)
                wait = self.wan.wait_s(delta_bytes) / self.ctx.dilation  # emulated seconds, as wan_s
                info = PlanInfo(md_have_tokens=have, delta_tokens=delta, delta_bytes=delta_bytes,
                                est_wan_wait_s=wait, wan_backlog_bytes=self.wan.backlog_bytes(),
                                wan_efficiency=self.wan.efficiency)
                if wait <= self.opts.wan_s:
                    self.wan.started(req.rid, delta_bytes)
                    self._index(r.name, "prefill").insert(req.prompt)
                    self.counts["offloaded"] += 1
                    return Plan(f"P({r.dc})-D({d.dc})", r.name, d.name, info=info, kv_transfer=self.opts.transfer,
                                kv_connections=self.opts.connections)
                self.counts["local (line busy)"] += 1
        self._index(p.name, "prefill").insert(req.prompt)
        self.counts["local"] += 1
        return Plan(f"P-D({d.dc})", p.name, d.name, kv_transfer=self.opts.transfer,
                    kv_connections=self.opts.connections)

    def _everything_away(self, req: RequestState, cluster: ClusterView) -> Plan:
        """A deployment with no prefill instance where requests enter (PrfaaS's "naive
        heterogeneous PD"): every prefill goes to the pool away, whatever the line does."""
        d = cluster.pick("decode", dc=self.ctx.home_dc, prompt=req.prompt)
        r = cluster.pick_outside("prefill", d.dc, prompt=req.prompt)
        have = self._index(d.name).match(req.prompt)
        delta_bytes = self.ctx.transfer_bytes(max(0, req.prompt_len - have))
        self.wan.started(req.rid, delta_bytes)
        self._index(r.name, "prefill").insert(req.prompt)
        self.counts["offloaded (no prefill home)"] += 1
        info = PlanInfo(md_have_tokens=have, delta_tokens=max(0, req.prompt_len - have), delta_bytes=delta_bytes)
        return Plan(f"P({r.dc})-D({d.dc})", r.name, d.name, info=info, kv_transfer=self.opts.transfer,
                    kv_connections=self.opts.connections)

    def decode_command(self, req: RequestState, plan: Plan, worker: str) -> DecodeCmd:
        return DecodeCmd(rid=req.rid, prompt=req.prompt.tolist(), max_new=req.max_new)

    def on_event(self, req: RequestState, event: Event) -> None:
        plan = req.plan
        if plan is None:
            return
        if isinstance(event, KvSent) and event.to == plan.decode and req.rid in self.wan.inflight:
            observed = None if self.streamed(plan) else event.queued_s + event.end - event.start
            self.wan.finished(req.rid, observed, event.cancelled)
        elif isinstance(event, KvReceived) and event.worker == plan.decode:
            self._index(event.worker).insert(req.prompt)  # the local decoder's cache now holds it
        elif isinstance(event, Failed):
            self.wan.inflight.pop(req.rid, None)

    def on_end(self, req: RequestState, error: str | None) -> None:
        if error is not None:  # as PDD's: no event would end its transfer's entry
            self.wan.inflight.pop(req.rid, None)

    def stats(self) -> PolicyReport:
        return PolicyReport(counts=dict(self.counts), wan_efficiency=self.wan.efficiency,
                            wan_samples=self.wan.samples, options=self.describe())
