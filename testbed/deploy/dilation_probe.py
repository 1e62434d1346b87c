"""``--dilation auto`` for a deployment of modeled instances: measured on the deployment itself.

A modeled step costs the host ~0.2 ms of Python, so what a modeled cluster cannot keep up
with is not compute but everything around it: timers that wake late while other processes
run, KV frames and token messages in the same event loops, the delay line. None of that can
be priced from one process, so the probe builds the actual deployment (every instance, the
broker, the router, the shaped WAN and its delay line), replays ``PROBE_REQUESTS`` requests
of the trace's busiest stretch at a candidate dilation, and reads the run's own fidelity
verdict. Candidates go up from ``PROBE_START`` by doubling; the first that passes, times
``PROBE_MARGIN`` (the full replay meets more of the trace than the probe), is the dilation.
A dilation below 1 runs the emulation faster than real time.

A probe passes on a stricter test than a run's verdict: a run may have 1 % of a worker's
steps end late, rounded up, which for a probe's few steps per worker is one step in
anything under a hundred, so a probe with 3 prefill steps per instance passed with a late
one and the full run at 1.5x its dilation failed (3 of 37 steps late). Here the steps of all
instances of a role are pooled and a probe passes only if no more than ``PROBE_LATE_SHARE``
of them (rounded down) ended late or overran.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from testbed.deploy.deployment import Deployment, Replayer
from testbed.deploy.emulation import EmulationPlan, round_up
from testbed.deploy.run_record import PolicyRun
from testbed.policies import parse_policy
from testbed.scenario import Role, Scenario
from testbed.traces.workload import RequestSpec

PROBE_REQUESTS = 32
PROBE_START = 0.5
PROBE_MAX = 32.0
PROBE_MARGIN = 1.5  # at 1.25 (D 2.5 after D 2 passed) 2 of 20 prefills of a 40-request run ended late
PROBE_LATE_SHARE = 0.005  # of a role's pooled probe steps that may end late: half what a run's verdict allows
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


def busiest_requests(specs: list[RequestSpec], n: int) -> list[RequestSpec]:
    """``n`` consecutive requests (in estimated send order) sent within the shortest span:
    the stretch of the trace that loads the host most. A turn whose predecessor is outside
    the stretch becomes an open-loop request at its estimated send time (its predecessor's
    plus the think time: the predecessor's own duration is not known before the run); the
    stretch is shifted to start at 0."""
    sent: dict[str, float] = {}
    for s in specs:  # a turn comes after its predecessor in a trace's order
        sent[s.rid] = s.at if s.after is None else sent.get(s.after, 0.0) + s.delay
    order = sorted(specs, key=lambda s: (sent[s.rid], s.rid))
    if len(order) <= n:
        return first_requests(specs, n)
    start = min(range(len(order) - n + 1), key=lambda i: (sent[order[i + n - 1].rid] - sent[order[i].rid], i))
    window = order[start:start + n]
    names = {s.rid for s in window}
    t0 = sent[window[0].rid]
    return [s if s.after in names else replace(s, after=None, delay=0.0, at=sent[s.rid] - t0)
            for s in window]  # fmt: skip


def late_by_role(run: PolicyRun) -> list[str]:
    """Roles whose pooled steps ended late or overran more than ``PROBE_LATE_SHARE`` allows."""
    pooled: dict[str, list[int]] = {}
    for w in run.workers.values():
        if w.device.native:
            continue
        acc = pooled.setdefault(w.role, [0, 0])
        acc[0] += w.device.steps
        acc[1] += w.device.late_wakes + w.device.overruns
    return [f"{role}: {bad} of {steps} steps late" for role, (steps, bad) in sorted(pooled.items())
            if bad > math.floor(PROBE_LATE_SHARE * steps)]


def probe_policy(sc: Scenario) -> str:
    """The policy that loads a deployment most: PDD where there is a relay (its relay and
    main decoder both work, KV crosses the WAN), else decode across the WAN."""
    return "pdd" if sc.hosts_with_role(Role.RELAY_DECODE) else "cross-dc"


def probe_dilation(sc: Scenario, specs_at: Callable[[float], list[RequestSpec]],
                   plan_at: Callable[[float], EmulationPlan], replay: Replayer) -> tuple[float, str]:
    """The dilation for this deployment, and why. ``specs_at(D)`` is the trace at dilation
    ``D`` (arrivals stretched), ``plan_at(D)`` the emulation plan, ``replay`` the load driver
    that sends a probe's requests (the caller's: a deployment imports no load driver)."""
    policy = parse_policy(probe_policy(sc))
    d, tried = PROBE_START, []
    while True:
        t0 = time.monotonic()
        specs = busiest_requests(specs_at(d), PROBE_REQUESTS)
        with Deployment(sc, policy, emulation=plan_at(d)) as dep:
            run = dep.run(replay(specs, PROBE_TIMEOUT_S * d, f"probe D {d:g}"))
        failed = sum(1 for r in run.recs.values() if not r.done or r.error)
        late = late_by_role(run)
        ok = run.verdict.passed and not failed and not late
        why = (run.verdict.reasons[0] if run.verdict.reasons else f"{failed} requests failed" if failed
               else f"{', '.join(late)}; a probe allows {100 * PROBE_LATE_SHARE:g} %")
        tried.append(f"D {d:g} {'passed' if ok else 'failed'}")
        print(f"dilation auto: probe at D {d:g}: {len(specs)} requests under {policy.label}, "
              f"{'passed' if ok else 'FAILED (' + why + ')'} [{time.monotonic() - t0:.0f} s]", flush=True)
        if ok:
            chosen = round_up(d * PROBE_MARGIN)
            return chosen, (f"auto: {len(specs)} requests of the trace's busiest stretch under {policy.label} kept "
                            f"their steps and frames on time at D {d:g} ({', '.join(tried)}) x {PROBE_MARGIN} margin")
        if d >= PROBE_MAX:
            return d, (f"auto: no probe passed up to D {d:g} ({', '.join(tried)}); the run's verdict will say why")
        d = min(PROBE_MAX, 2 * d)
