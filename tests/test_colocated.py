"""The colocated baseline (``workers/colocated.py``, policy ``colocated``): an instance that
prefills and decodes in mixed steps. The step arithmetic, the simulator end to end (the same
tokens as a disaggregated pair, its own prefix cache, nothing on the wire), and the cost
disaggregation removes: a long prompt's chunks slow the decodes that share their steps. The
emulation's reference tokens: ``tests/test_pipelines.py``."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.messages import KvReceived, KvSent, PrefillDone
from protocol.worker_config import DeviceSpec, ModelCost, Scales
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.device import make_pacer

from .conftest import TOPOLOGIES

COST = ModelCost(params=7.61e9, layers=28, hidden=3584, kv_bytes_per_token=57344, weight_bytes=7.61e9 * 2)
DEV = DeviceSpec(name="gpu", peak_tflops=989, mem_gbps=3350, step_overhead_ms=2.0, prefill_chunk=8192,
                 compute_efficiency=0.5, decode_compute_efficiency=0.2)


def test_a_mixed_step_is_a_decode_step_without_prompts_and_a_packed_pass_without_decodes() -> None:
    pacer = make_pacer(DEV, COST, Scales(s_in=16, s_out=16, dilation=2.0))
    contexts = [100, 250, 4000]
    assert pacer.mixed_time(contexts, [], 8192) == (pytest.approx(pacer.decode_time(contexts), rel=1e-9), [])
    total, ends = pacer.mixed_time([], [(300, 40), (100, 0)], 8192)  # 6,400 emulated tokens: one pass
    assert total == pytest.approx(pacer.packed_time([(300, 40), (100, 0)]), rel=1e-9) and ends == [total, total]
    assert pacer.mixed_room(0, 8192) == 512 and pacer.mixed_room(3, 8192) == 16 * 8189 // 16


def test_a_mixed_step_prices_prompts_beside_the_decodes_and_says_when_each_prompt_ends() -> None:
    pacer = make_pacer(DEV, COST, Scales(s_in=16, s_out=16, dilation=1.0))
    contexts = [100, 250]
    alone = pacer.decode_time(contexts)
    # 1,000 replayed tokens: 16,000 emulated over passes of 8,190 beside the two decode rows:
    # the first prompt (100 replayed) ends in the first pass, the second in the second.
    total, ends = pacer.mixed_time(contexts, [(100, 0), (900, 50)], 8192)
    # Dearer than the decode step alone, cheaper than it and the prompts' pass apart (the
    # passes they share read the weights once and pay one overhead).
    assert alone < total < alone + pacer.packed_time([(100, 0), (900, 50)])
    assert 0 < ends[0] < ends[1] < total
    # The decode rows' share of the budget: fewer prompt tokens fit a pass beside more rows.
    assert pacer.mixed_room(100, 8192) < pacer.mixed_room(2, 8192)
    # A budget no larger than the rows still leaves a token to prompts (never starved), in passes of their own.
    assert pacer.mixed_room(8192, 8192) == 1
    assert pacer.mixed_time([10] * 8192, [(1, 0)], 8192)[0] > pacer.decode_time([10] * 8192)


def _scenario(compute: str, instances: int) -> Any:
    hosts = {f"colo-{i}": {"role": "colocated", "device": "h100", "compute": compute} for i in range(instances)}
    return load_scenario(TOPOLOGIES / "two-dc.yaml", {"datacenters": {"a": {"hosts": hosts}}})


def _run(policy: str, specs: list[RequestSpec], compute: str = "real", instances: int = 2) -> Any:
    sc = _scenario(compute, instances)
    with SimDeployment(sc, parse_policy(policy), emulation=sim_plan(sc, 16)) as dep:
        return dep.run(TraceReplay(specs, 600, show_progress=False))


def test_colocated_gives_the_tokens_of_a_disaggregated_pair_from_its_own_prefix_cache() -> None:
    # Three sessions of two turns, the second turn's prompt the first's plus more, sent once the
    # first has ended: each session's turns go to one instance (prefix affinity) and the second
    # prefills only what its cache lacks.
    specs = []
    for s in range(3):
        first = synth_tokens(f"colo-{s}", 300 + 40 * s)
        specs.append(RequestSpec(f"s{s}.0", first, 12, at=0.05 * s))
        specs.append(RequestSpec(f"s{s}.1", first + synth_tokens(f"colo-{s}-more", 90), 12, at=3.0 + 0.05 * s))
    colo, pd = _run("colocated", specs), _run("same-dc", specs)
    assert all(r.ok for r in [*colo.recs.values(), *pd.recs.values()])
    assert {k: list(r.tokens) for k, r in colo.recs.items()} == {k: list(r.tokens) for k, r in pd.recs.items()}
    for rid, rec in colo.router.items():
        assert rec.pipeline == "C(a)" and rec.prefill == rec.decode and rec.prefill.startswith("colo-")
        assert not any(isinstance(e, KvSent) for e in rec.events)  # the KV never left the instance
        done = next(e for e in rec.events if isinstance(e, PrefillDone))
        got = next(e for e in rec.events if isinstance(e, KvReceived))
        assert got.bytes == 0 and got.had == done.hit_tokens
        if rid.endswith(".1"):
            first = colo.router[rid.replace(".1", ".0")]
            assert rec.decode == first.decode and done.hit_tokens >= 288, (rid, done)
    computed = sum(w.prefill.computed_tokens for w in colo.workers.values() if w.role == "colocated" and w.prefill)
    assert computed == sum(len(s.prompt) for s in specs) - sum(
        next(e for e in r.events if isinstance(e, PrefillDone)).hit_tokens for r in colo.router.values())


def test_a_long_prompt_slows_the_decodes_sharing_its_steps_on_a_colocated_instance_only() -> None:
    # A short request decoding 40 tokens; a prompt of 3,000 replayed tokens (48,000 emulated)
    # arrives while it decodes. Colocated, the prompt's chunks share the decode's steps (the
    # interference disaggregation removes); disaggregated, the decoder never sees them.
    short = RequestSpec("short", synth_tokens("short", 64), 40, at=0.0)
    long_ = RequestSpec("long", synth_tokens("long", 3000), 4, at=0.2)
    gaps = {}
    for policy in ("colocated", "same-dc"):
        run = _run(policy, [short, long_], compute="modeled", instances=1)
        assert all(r.ok for r in run.recs.values())
        t = list(run.recs["short"].token_times)
        gaps[policy] = max(b - a for a, b in zip(t, t[1:], strict=False))
        if policy == "colocated":
            colo = run.workers[run.router["short"].decode]
            assert colo.device.by_kind.get("mixed", (0, 0))[0] >= 1
    assert gaps["colocated"] > 3 * gaps["same-dc"], gaps
