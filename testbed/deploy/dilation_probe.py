"""``--dilation auto`` for a deployment of modeled instances: measured on the deployment itself.

A modeled step costs the host ~0.2 ms of Python, so what a modeled cluster cannot keep up
with is not compute but everything around it: timers that wake late while other processes
run, KV frames and token messages in the same event loops, the delay line. None of that can
be priced from one process, so the probe builds the actual deployment (every instance, the
broker, the router, the shaped WAN and its delay line), replays the trace's first
``PROBE_REQUESTS`` requests at a candidate dilation, and reads the run's own fidelity
verdict. Candidates go up from ``PROBE_START`` by doubling; the first that passes, times
``PROBE_MARGIN`` (the full replay meets more of the trace than its start), is the dilation.
A dilation below 1 runs the emulation faster than real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from testbed.deploy.deployment import Deployment
from testbed.deploy.emulation import EmulationPlan, round_up
from testbed.load.trace_replay import TraceReplay
from testbed.policies.spec import parse_policy
from testbed.scenario import Role, Scenario
from testbed.traces.workload import RequestSpec

PROBE_REQUESTS = 16
PROBE_START = 0.5
PROBE_MAX = 32.0
PROBE_MARGIN = 1.5  # at 1.25 (D 2.5 after D 2 passed) 2 of 20 prefills of a 40-request run ended late
PROBE_TIMEOUT_S = 120.0  # emulated seconds a probe request may take before it fails


def first_requests(specs: list[RequestSpec], n: int) -> list[RequestSpec]:
    """The first ``n`` requests, without a closed-loop turn whose predecessor is left out."""
    kept: list[RequestSpec] = []
    names: set[str] = set()
    for s in specs:
        if len(kept) == n:
            break
        if s.after is None or s.after in names:
            kept.append(s)
            names.add(s.rid)
    return kept


def probe_policy(sc: Scenario) -> str:
    """The policy that loads a deployment most: PDD where there is a relay (its relay and
    main decoder both work, KV crosses the WAN), else decode across the WAN."""
    return "pdd" if sc.hosts_with_role(Role.RELAY_DECODE) else "cross-dc"


def probe_dilation(sc: Scenario, specs_at: Callable[[float], list[RequestSpec]],
                   plan_at: Callable[[float], EmulationPlan]) -> tuple[float, str]:
    """The dilation for this deployment, and why. ``specs_at(D)`` is the trace at dilation
    ``D`` (arrivals stretched), ``plan_at(D)`` the emulation plan."""
    policy = parse_policy(probe_policy(sc))
    d, tried = PROBE_START, []
    while True:
        t0 = time.monotonic()
        specs = first_requests(specs_at(d), PROBE_REQUESTS)
        with Deployment(sc, policy, emulation=plan_at(d)) as dep:
            run = dep.run(TraceReplay(specs, PROBE_TIMEOUT_S * d, f"probe D {d:g}", show_progress=False))
        failed = sum(1 for r in run.recs.values() if not r.done or r.error)
        ok = run.verdict.passed and not failed
        why = run.verdict.reasons[0] if run.verdict.reasons else f"{failed} requests failed"
        tried.append(f"D {d:g} {'passed' if ok else 'failed'}")
        print(f"dilation auto: probe at D {d:g}: {len(specs)} requests under {policy.label}, "
              f"{'passed' if ok else 'FAILED (' + why + ')'} [{time.monotonic() - t0:.0f} s]", flush=True)
        if ok:
            chosen = round_up(d * PROBE_MARGIN)
            return chosen, (f"auto: the deployment's first {len(specs)} requests under {policy.label} kept "
                            f"every step and frame on time at D {d:g} ({', '.join(tried)}) x {PROBE_MARGIN} margin")
        if d >= PROBE_MAX:
            return d, (f"auto: no probe passed up to D {d:g} ({', '.join(tried)}); the run's verdict will say why")
        d = min(PROBE_MAX, 2 * d)
