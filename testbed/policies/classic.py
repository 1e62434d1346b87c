"""The two classic PD pipelines.

Both prefill where requests enter (``PolicyContext.home_dc``; a scenario may also have prefill
instances in the other datacenter, for ``prefill-offload``).

* ``same-dc``: prefill and decode in the prefill's datacenter (KV over the LAN).
* ``cross-dc``: prefill in the first datacenter, decode in the other; decoding starts only
  once the whole KV (what the decoder's prefix cache lacks) has crossed the WAN — the naive
  baseline PDD improves on; ``cross-dc:transfer=per-chunk`` streams each prefill pass's KV
  as the pass ends, as an engine with a layer- or chunk-wise KV connector does.

Both take ``transfer`` (``after-prefill`` | ``per-chunk`` | ``per-layer``; unset: the
scenario's ``kv_transfer``) and ``connections`` (TCP connections per transfer; unset: the
scenario's ``kv_connections``). With packed prefill passes, ``per-chunk`` over one connection is
the strongest cross-datacenter baseline measured (docs/results.md).
"""

from __future__ import annotations

from testbed.policies.base import ClusterView, Plan, Policy, RequestState, TransferOptions
from testbed.policies.registry import register


@register
class SameDc(Policy):
    name = "same-dc"
    Options = TransferOptions
    opts: TransferOptions
    deploys = (("prefill", "home"), ("decode", "home"))

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        d = cluster.pick("decode", dc=p.dc, prompt=req.prompt)
        return Plan(f"P-D({d.dc})", p.name, d.name, kv_transfer=self.opts.transfer,
                    kv_connections=self.opts.connections)


@register
class CrossDc(Policy):
    name = "cross-dc"
    Options = TransferOptions
    opts: TransferOptions
    deploys = (("prefill", "home"), ("decode", "away"))
    crosses_wan = True

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        d = cluster.pick_outside("decode", p.dc, prompt=req.prompt)
        return Plan(f"P-D({d.dc})", p.name, d.name, kv_transfer=self.opts.transfer,
                    kv_connections=self.opts.connections)
