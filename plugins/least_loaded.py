"""Decode wherever fewest requests wait, a crossing of the line counted as ``cross`` more.

The tutorial's policy (docs/policies.md, "Writing a policy"): what a user writes in an
afternoon. Prefill where requests enter; then the decoder, near or across the WAN, with the
fewest requests in flight, one across the line charged ``cross`` requests more (its KV has
to cross first). ``cross=0`` balances blindly; a large ``cross`` is same-dc.

    testbed run --engine sim --scenario topologies/two-dc.yaml --trace traces/agentic-quick.jsonl \\
        --token-scale 16 --policies same-dc,cross-dc,plugins/least_loaded.py:LeastLoaded:cross=4
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from testbed.policies import ClusterView, Plan, Policy, RequestState, WorkerView, register


class LeastLoadedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cross: int = Field(default=4, ge=0, le=32, description="requests a decoder across the line counts extra")


@register
class LeastLoaded(Policy):
    name = "least-loaded"
    Options = LeastLoadedOptions
    opts: LeastLoadedOptions
    deploys = (("prefill", "home"), ("decode", "home"), ("decode", "away"))
    crosses_wan = True

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        decoders = [w for w in cluster.workers.values() if w.role == "decode" and w.up]
        if not decoders:
            raise LookupError("no live decode worker")

        def score(w: WorkerView) -> tuple[int, str]:  # fewest in flight; ties by name: runs repeat
            return w.assigned + (self.opts.cross if w.dc != p.dc else 0), w.name

        d = min(decoders, key=score)
        return Plan(f"P-D({d.dc})", p.name, d.name)
