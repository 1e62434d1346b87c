"""One policy's run, measured: the per-request rows and the typed ``PolicySummary``."""

from __future__ import annotations

import pandas as pd

from testbed.analysis.cost import cost_per_million_tokens, egress_price, hardware_cost
from testbed.analysis.fault_impact import fault_impacts
from testbed.analysis.metrics import Slo, itls, request_rows, summarize
from testbed.analysis.planned_hit import planned_hits
from testbed.analysis.results import PolicySummary
from testbed.analysis.wan_line import line_of
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.run_record import PolicyRun
from testbed.policies import PolicySpec, make_policy
from testbed.scenario import Scenario


def measure(sc: Scenario, spec: PolicySpec, plan: EmulationPlan, run: PolicyRun,
            slo: Slo) -> tuple[pd.DataFrame, PolicySummary]:
    """One policy's request rows and summary (latencies, cost, policy counters, verdict)."""
    planned = planned_hits(run.recs, run.specs, sc.workers.block_size, sc.workers.cache_outputs)
    df = request_rows(run.recs, run.router, run.specs, plan.scales, planned)
    measured = summarize(df, itls(run.recs, plan.scales), slo, run.recs, plan.scales)
    cost = hardware_cost(sc, make_policy(spec))
    wan_gb = measured.wan_kv_bytes / plan.byte_factor / 1e9  # wire bytes back to the emulated model's
    egress = egress_price(sc, wan_gb)
    tokens = measured.output_tokens_emulated
    per_mtok = cost_per_million_tokens(cost, measured.duration_s, tokens) if cost else None
    with_egress = cost_per_million_tokens(cost, measured.duration_s, tokens, egress or 0.0) if cost else None
    t0 = min((r.sent for r in run.recs.values() if r.sent), default=0.0)  # the rows' origin
    lines = {name: line_of(b, t0, plan.dilation) for name, b in run.wan_line.items()}
    return df, PolicySummary(**dict(measured), policy_stats=run.policy, fidelity=run.verdict, cost=cost,
                             cost_per_mtok=per_mtok, wan_gb=wan_gb, egress=egress,
                             cost_per_mtok_with_egress=with_egress, impairment=run.impairment, faults=run.faults,
                             fault_impact=fault_impacts(run, plan.dilation), wan_line=lines,
                             component_errors=run.component_errors)
