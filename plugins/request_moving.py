"""Request-moving routing: a full PD stack in each datacenter, and each request sent whole to
the one that scores best. The request and its tokens cross the WAN; its KV never does.

The design that SkyWalker (EuroSys'26), GORGO (2026) and NVIDIA Dynamo's global router ship
across datacenters, as opposed to PDD's and cross-dc's moving of KV. Per request, for each
datacenter that has a live prefill and a live decoder:

    score = uncached tokens at that stack's prefill (emulated; a shadow prefix index of the
            prompts sent to it: a session's turns find their history where they went before)
          + ``load_tokens`` x requests in flight on that prefill and decoder
          + ``rtt_tokens`` if the stack is not where requests enter (the prompt's and every
            token's way across the line, and the farther client)

and the lowest wins (ties: the home datacenter). Pipelines ``P-D(a)`` and ``P(b)-D(b)``.
Needs a prefill and a decoder in both datacenters (``topologies/offload.yaml``,
``topologies/paper-two-stacks.yaml``); a datacenter without a live pair is skipped.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from protocol.policy import PolicyReport
from testbed.policies import ClusterView, Plan, Policy, RequestState, register
from testbed.policies.prefix_index import PrefixIndex


class RequestMovingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    load_tokens: int = Field(default=8192, ge=0, le=65536, description="uncached tokens a request in flight costs")
    rtt_tokens: int = Field(default=4096, ge=0, le=65536, description="uncached tokens a move across the line costs")


@register
class RequestMoving(Policy):
    name = "request-moving"
    Options = RequestMovingOptions
    opts: RequestMovingOptions
    deploys = (("prefill", "home"), ("decode", "home"), ("prefill", "away"), ("decode", "away"))
    needs = (("prefill", "away"), ("decode", "away"))
    crosses_wan = True  # requests and tokens, never KV

    def __init__(self, options: RequestMovingOptions | None = None) -> None:
        super().__init__(options)
        self.indexes: dict[str, PrefixIndex] = {}
        self.counts: Counter[str] = Counter()

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.indexes.values())

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        best: tuple[float, int, str, str] | None = None
        for dc in sorted({w.dc for w in cluster.workers.values()}):
            try:
                p = cluster.pick("prefill", dc=dc, prompt=req.prompt)
                d = cluster.pick("decode", dc=dc, prompt=req.prompt)
            except LookupError:
                continue  # no live stack there
            index = self.indexes.setdefault(p.name, PrefixIndex.shadowing(self.ctx, "prefill"))
            uncached = (req.prompt_len - index.match(req.prompt)) * self.ctx.token_scale
            away = dc != self.ctx.home_dc
            score = uncached + self.opts.load_tokens * (p.assigned + d.assigned) + self.opts.rtt_tokens * away
            if best is None or (score, away) < best[:2]:
                best = (score, away, p.name, d.name)
        if best is None:
            raise LookupError("no datacenter has a live prefill and decoder")
        _, away, prefill, decode = best
        dc = cluster.workers[prefill].dc
        self.indexes[prefill].insert(req.prompt)
        self.counts[f"moved to {dc}" if away else f"kept in {dc}"] += 1
        return Plan(f"P({dc})-D({dc})" if away else f"P-D({dc})", prefill, decode)

    def stats(self) -> PolicyReport:
        return PolicyReport(counts=dict(self.counts), options=self.describe())
