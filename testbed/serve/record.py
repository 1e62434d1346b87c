"""A served session saved as a run directory, the same files ``testbed run`` writes.

The requests the front end received become rows like a replay's (``RequestSpec`` +
``ClientRecord`` + the router's ``RequestRecord``): times are taken where the front end
sits (sent when it published the request, each token when it reached it), in emulated
seconds as everywhere; ``summary.json``'s trace says where they came from (the URL).
An external client's own measurement of the same requests is set beside these by
``testbed.serve.compare``.
"""

from __future__ import annotations

from pathlib import Path

from testbed.analysis import report
from testbed.analysis.metrics import Slo
from testbed.analysis.policy_summary import measure
from testbed.analysis.results import RunSummary, TraceInfo
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.run_record import PolicyRun
from testbed.policies.spec import PolicySpec
from testbed.scenario import Scenario

SERVED_FORMAT = "openai-http"


def save_served(out: Path, sc: Scenario, plan: EmulationPlan, policy: PolicySpec, run: PolicyRun, url: str,
                slo: Slo | None = None) -> list[Path]:
    df, summary = measure(sc, policy, plan, run, slo or Slo())
    info = TraceInfo(trace=url, format=SERVED_FORMAT, requests=len(run.specs), token_scale=plan.scales.s_in,
                     block_size=sc.workers.block_size, meta={"served_by": "testbed serve"})
    run_summary = RunSummary(trace=info, speed=1.0, limit=None, window=None, emulation=plan.summary(sc),
                             scenario=sc, policies={policy.label: summary}, workers={policy.label: run.workers})
    return report.save(out, {policy.label: df}, run_summary)
