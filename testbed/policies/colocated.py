"""``colocated``: no disaggregation, the baseline every PD design should beat first.

Each request goes to one instance that prefills and decodes it (role ``colocated``,
``workers/colocated.py``: mixed batches, chunked prefill under the token budget), in the
datacenter requests enter: the one expected to hold the longest prefix of its prompt, unless
that one has more than ``AFFINITY_SLACK`` requests beyond the least loaded (then the least
loaded), as SGLang's cache-aware router and llm-d's prefix scorer route. Its KV never leaves
the instance; nothing crosses the WAN.
"""

from __future__ import annotations

from testbed.policies.base import ClusterView, Plan, Policy, RequestState
from testbed.policies.registry import register


@register
class Colocated(Policy):
    name = "colocated"
    deploys = (("colocated", "home"),)
    needs = (("colocated", "home"),)

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        w = cluster.pick("colocated", dc=self.ctx.home_dc, prompt=req.prompt)
        return Plan(f"C({w.dc})", w.name, w.name)
