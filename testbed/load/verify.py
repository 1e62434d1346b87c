"""``testbed verify``: every pipeline's greedy tokens must equal a single-process reference.

Relaying policies get a fixed eager-token budget per request (``EAGER_BUDGETS``), so the
relay -> main decoder handoff happens after 0, 1, 3, ... tokens for real instead of only
when the WAN happens to be fast enough.

Prompts share prefixes on purpose (groups with a common head), so prefix caches, partial
KV transfers and batching of different lengths are all exercised. The reference is
transformers ``generate(do_sample=False)`` on the same weights and dtype (float64 by
default: batching and chunking then cannot flip a greedy choice).
"""

from __future__ import annotations

import json
import random
from typing import Any

from protocol.messages import Extended, RequestHints
from testbed.deploy.deployment import Deployment
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.model_files import ensure_model
from testbed.deploy.run_record import ClientRecord
from testbed.errors import InputError
from testbed.load.trace_replay import TraceReplay
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model_dir import kv_bytes_per_token

# Eager-token budgets given to the requests in turn: a relaying policy (pdd) hands each
# request over after exactly this many relay tokens, so every handoff count is exercised
# whatever the WAN's speed (other policies ignore it).
EAGER_BUDGETS = (0, 1, 3, 8, 15, 31, 63)


def verification_prompts(n: int = 24, seed: int = 7, max_len: int = 2048) -> list[RequestSpec]:
    """``n`` prompts of 16..max_len tokens in prefix-sharing groups, 1..64 output tokens,
    each with an eager-token budget for relaying policies."""
    rng = random.Random(seed)
    groups = [synth_tokens(f"verify-{seed}-{g}", rng.choice([16, 48, 256, max_len // 2])) for g in range(4)]
    specs = []
    lengths = [16, max_len] + [rng.randint(17, max_len) for _ in range(n - 2)]
    outs = [1, 64] + [rng.choice([1, 2, 7, 16, 33, 64]) for _ in range(n - 2)]
    for i in range(n):
        head = groups[i % len(groups)][: lengths[i] - 1]
        prompt = head + synth_tokens(f"verify-{seed}-tail-{i}", lengths[i] - len(head))
        specs.append(RequestSpec(f"v{i:03d}", prompt, outs[i], at=0.05 * i,
                                 hints=RequestHints(eager=EAGER_BUDGETS[i % len(EAGER_BUDGETS)])))
    return specs


def compare(specs: list[RequestSpec], refs: dict[str, list[int]], recs: dict[str, ClientRecord]
            ) -> list[dict[str, Any]]:
    """One row per mismatching or failed request (empty = all equal)."""
    bad = []
    for s in specs:
        r = recs[s.rid]
        if not r.ok:
            bad.append({"rid": s.rid, "problem": f"failed: {r.error}"})
        elif r.conflicts:
            bad.append({"rid": s.rid, "problem": f"{r.conflicts} streamed chunk(s) disagreed with tokens received"})
        elif (got := list(r.tokens)) != refs[s.rid]:
            at = next((i for i, (a, b) in enumerate(zip(got, refs[s.rid], strict=False)) if a != b),
                      min(len(got), len(refs[s.rid])))
            bad.append({"rid": s.rid, "problem": f"token {at} differs (got {got[at:at + 3]}, "
                        f"reference {refs[s.rid][at:at + 3]}; lengths {len(got)}/{len(refs[s.rid])})"})
    return bad


def run_verify(sc: Scenario, impairment: str, policies: list[PolicySpec], prompts: int = 24, seed: int = 7,
               dtype: str = "float64", as_json: bool = False, dilation: float = 1.0) -> int:
    """``testbed verify``: every policy on a fresh network against the reference. Exit 0 when
    every request of every policy equals it token for token, 1 otherwise. Workers are paced
    as the scenario's emulation says (token scale 1, this dilation): pacing only waits, so
    tokens must not change."""
    from workers.model import ModelRunner  # torch

    if not 0.1 <= dilation <= 1000:
        raise InputError(f"--dilation: must be between 0.1 and 1000, got {dilation:g}")
    modeled = [h for dc in sc.datacenters.values() for h, spec in dc.hosts.items() if spec.compute == "modeled"]
    if modeled:
        where = f" ({sc.source})" if sc.source else ""
        raise InputError(f"scenario {sc.name}{where}: verify needs real compute, but {', '.join(modeled)} "
                         "run compute: modeled (their tokens come from no model)")
    specs = verification_prompts(prompts, seed)
    model = ensure_model(sc.model_dir())
    plan = EmulationPlan.make(sc, 1, dilation, kv_bytes_per_token(model, dtype))
    for s in specs:
        s.at *= plan.dilation
    ref_runner = ModelRunner(model, dtype)
    if not as_json:
        print(f"reference: generate(do_sample=False), {len(specs)} prompts, dtype {dtype}", flush=True)
    refs = {s.rid: ref_runner.reference(list(s.prompt), s.max_new) for s in specs}
    results: dict[str, dict[str, Any]] = {}
    for spec in policies:
        with Deployment(sc, spec, emulation=plan, impairment=impairment, dtype=dtype) as dep:
            run = dep.run(TraceReplay(specs, label=spec.label))
        bad = compare(specs, refs, run.recs)
        pipelines: dict[str, int] = {}
        for r in run.router.values():
            pipelines[str(r.pipeline)] = pipelines.get(str(r.pipeline), 0) + 1
        eager = sum(run.recs[rid].by_worker.get(r.relay or "", 0) for rid, r in run.router.items() if rid in run.recs)
        handoffs = sum(1 for r in run.router.values() if any(isinstance(e, Extended) and e.final for e in r.events))
        p = spec.label
        results[p] = {"requests": len(specs), "mismatches": bad, "tokens": sum(len(r) for r in refs.values()),
                      "pipelines": pipelines, "eager_tokens": eager, "handoffs": handoffs}
        if not as_json:
            verdict = "OK: identical to the reference" if not bad else f"FAIL: {len(bad)} requests differ"
            shape = ", ".join(f"{k} {v}" for k, v in sorted(pipelines.items()))
            relayed = any(r.relay for r in run.router.values())
            extra = f", {eager} eager tokens, {handoffs} requests handed over" if relayed else ""
            print(f"{p}: {len(specs)} requests, {results[p]['tokens']} tokens ({shape}{extra}): {verdict}")
            for b in bad:
                print(f"  {b['rid']}: {b['problem']}")
    ok = all(not r["mismatches"] for r in results.values())
    if as_json:
        print(json.dumps({"passed": ok, "policies": results}, indent=2))
    return 0 if ok else 1
