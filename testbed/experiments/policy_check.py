"""``testbed policy check SPEC``: what a user must know before trusting a policy.

A policy (built in, or a plugin: ``FILE.py:Class[:k=v,...]``) runs through the simulator on a
short replay with faults (a decoder it uses killed for a while, the line down for a while),
twice with the same seed, and the check reports:

* **loads**: its class, options and the roles it needs are there (a bad plugin already ended
  the command with exit 2, naming file and line);
* **every request ends**: completed, or failed with a reason; no component raised;
* **no plan names an absent or dead worker**: every worker of every plan is one of the
  deployment's, and none was planned while the router held it dead (between its death and
  the fault's end);
* **deterministic**: the second run planned every request as the first and measured the
  same TTFT (a policy drawing from an unseeded generator fails here);
* **as declared**: every worker it planned has a role and place its ``deploys`` lists, and
  KV crossed the line only if it says it ``crosses_wan``;
* **tokens equal the reference** (root only): ``verify`` on the emulation, a handful of
  prompts, every pipeline's greedy tokens against a single-process reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from testbed.analysis.cost import home_datacenters, missing_for
from testbed.deploy.run_record import PolicyRun
from testbed.faults.timeline import parse_fault
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import run_verify
from testbed.policies import PolicySpec, make_policy
from testbed.scenario import Scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces.workload import Workload

KILL_AT_S, KILL_FOR_S = 6.0, 4.0  # a decoder of its plans killed for a while (emulated s)
WAN_DOWN_AT_S, WAN_DOWN_FOR_S = 14.0, 3.0


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not run (and why in ``detail``)
    detail: str


def _replay(sc: Scenario, spec: PolicySpec, wl: Workload, faults: list[str]) -> PolicyRun:
    with SimDeployment(sc, spec, emulation=sim_plan(sc, wl.token_scale),
                       timeline=[parse_fault(f) for f in faults]) as dep:
        return dep.run(TraceReplay(wl.specs(1.0), 1800.0, f"check {spec.label}", show_progress=False))


def check_policy(sc: Scenario, spec: PolicySpec, wl: Workload, verify_sc: Scenario | None) -> list[Check]:
    policy = make_policy(spec)
    checks = [Check("loads", not missing_for(sc, policy),
                    f"{spec.source or 'built in'}: {policy.describe()}"
                    + "".join(f"; needs {m}" for m in missing_for(sc, policy)))]
    if not checks[0].passed:
        return checks
    first = _replay(sc, spec, wl, [])
    used = sorted({w for r in first.router.values() for w in r.workers})
    home = home_datacenters(sc)
    victim = next((w for w in used if sc.host(w).role.value in ("decode", "relay-decode")), None) or \
        next(iter(used), None)
    faults = [f"wan-down@{WAN_DOWN_AT_S:g}+{WAN_DOWN_FOR_S:g}"]
    if victim is not None:
        faults.insert(0, f"kill@{KILL_AT_S:g}+{KILL_FOR_S:g}:host={victim}")
    runs = [_replay(sc, spec, wl, faults) for _ in range(2)]
    run = runs[0]

    unended = [rid for rid, r in run.recs.items() if not (r.ok or (r.done and r.error))]
    checks.append(Check("every request ends", not unended and not run.component_errors,
                        f"{sum(r.ok for r in run.recs.values())} completed, "
                        f"{sum(bool(r.error) for r in run.recs.values())} failed with a reason of "
                        f"{len(run.recs)} under {', '.join(faults)}"
                        + (f"; never ended: {', '.join(unended[:5])}" if unended else "")
                        + (f"; {run.component_errors[0]}" if run.component_errors else "")))

    hosts = {h for dc in sc.datacenters.values() for h in dc.hosts}
    absent = sorted({w for r in run.router.values() for w in r.workers if w not in hosts})
    cleared = {f.fault: f.cleared_s for f in run.faults}
    kill_end = next((c for k, c in cleared.items() if k.startswith("kill@")), None)
    dead_planned = []
    for death in run.deaths:
        until = run.fault_t0 + (kill_end if kill_end is not None else float("inf"))
        for rid, r in run.router.items():
            sent = run.recs[rid].sent if rid in run.recs else None
            if sent is not None and death.t < sent < until and death.worker in r.workers:
                dead_planned.append(f"{rid} -> {death.worker}")
    checks.append(Check("no plan names an absent or dead worker", not absent and not dead_planned,
                        f"{len(run.router)} plans; {len(run.deaths)} death(s) seen"
                        + (f"; absent: {', '.join(absent)}" if absent else "")
                        + (f"; planned onto the dead: {', '.join(dead_planned[:5])}" if dead_planned else "")))

    def shape(r: PolicyRun) -> dict[str, tuple[object, ...]]:
        return {rid: (x.pipeline, *x.workers, r.recs[rid].error if rid in r.recs else None,
                      r.recs[rid].token_times[0] if rid in r.recs and r.recs[rid].token_times else None)
                for rid, x in r.router.items()}

    a, b = shape(runs[0]), shape(runs[1])
    differ = sorted(rid for rid in set(a) | set(b) if a.get(rid) != b.get(rid))
    first_diff = f"e.g. {differ[0]}: {a.get(differ[0])} vs {b.get(differ[0])}" if differ else ""
    checks.append(Check("deterministic under a seed", not differ,
                        "the second run planned and timed every request as the first" if not differ
                        else f"{len(differ)} requests differ, {first_diff}"))

    undeclared = set()
    for r in run.router.values():
        for w in r.workers:
            if w in hosts:
                where = "home" if sc.datacenter_of(w) in home else "away"
                if (sc.host(w).role.value, where) not in policy.deploys:
                    undeclared.add(f"{w} ({sc.host(w).role.value}, {where})")
    wan = sum(sum(line.bytes) for line in first.wan_line.values())
    crossed = wan > 0
    checks.append(Check("as declared", not undeclared and (crossed <= policy.crosses_wan),
                        f"pipelines {', '.join(sorted({str(r.pipeline) for r in first.router.values()}))}; "
                        f"KV over the WAN {wan / 1e6:.1f} MB (wire), crosses_wan={policy.crosses_wan}"
                        + (f"; planned outside deploys: {', '.join(sorted(undeclared))}" if undeclared else "")))

    if verify_sc is None:
        checks.append(Check("tokens equal the reference", None, "not run (--no-verify)"))
    elif os.geteuid() != 0:
        checks.append(Check("tokens equal the reference", None, "not run: the emulation needs root"))
    elif any(h.compute == "modeled" for dc in verify_sc.datacenters.values() for h in dc.hosts.values()):
        checks.append(Check("tokens equal the reference", None, f"not run: {verify_sc.name} runs modeled compute"))
    elif missing := missing_for(verify_sc, policy):
        checks.append(Check("tokens equal the reference", None, f"not run: {verify_sc.name} lacks {missing[0]}"))
    else:
        code = run_verify(verify_sc, "auto", [spec], prompts=8)
        checks.append(Check("tokens equal the reference", code == 0,
                            f"verify on {verify_sc.name}: 8 prompts, every pipeline "
                            + ("identical" if code == 0 else "DIFFERS (above)")))
    return checks


def format_checks(spec: PolicySpec, checks: list[Check]) -> str:
    mark = {True: "pass", False: "FAIL", None: "-"}
    lines = [f"policy check: {spec.label}" + (f" ({spec.source})" if spec.source else ""), ""]
    width = max(len(c.name) for c in checks)
    lines += [f"  {mark[c.passed]:4}  {c.name:{width}}  {c.detail}" for c in checks]
    failed = [c.name for c in checks if c.passed is False]
    lines += ["", "passed" if not failed else f"FAILED: {', '.join(failed)}"]
    return "\n".join(lines)
