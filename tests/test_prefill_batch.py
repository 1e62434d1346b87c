"""Prefill passes packing several requests under a token budget (``workers.prefill_token_budget``):
the pass arithmetic, the packing in the simulator (fewer passes, the same tokens), requests timing
out inside the passes. The emulated network's reference tokens with packed passes, PDD's relay and
a streamed transfer: ``tests/test_kv_stream.py``."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.messages import PrefillDone
from protocol.worker_config import DeviceSpec, ModelCost, Scales
from testbed.load.trace_replay import TraceReplay
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.device import make_pacer

from .conftest import TOPOLOGIES

COST = ModelCost(params=7.61e9, layers=28, hidden=3584, kv_bytes_per_token=57344, weight_bytes=7.61e9 * 2)
DEV = DeviceSpec(name="gpu", peak_tflops=989, mem_gbps=3350, step_overhead_ms=2.0, prefill_chunk=8192)


def test_a_packed_pass_is_priced_as_one_pass_of_all_its_rows_each_at_its_own_context() -> None:
    pacer = make_pacer(DEV, COST, Scales(s_in=16, s_out=16, dilation=1.0))
    alone = pacer.packed_time([(512, 100)])
    assert alone == pytest.approx(pacer.prefill_time(512, 100), rel=1e-12)  # one request: today's pass
    both = pacer.packed_time([(512, 100), (88, 0)])
    # One overhead and one read of the weights for both: less than the two passes apart, more than either.
    assert alone < both < alone + pacer.packed_time([(88, 0)])
    # Attention is each request's own: a long context costs its own part only.
    assert pacer.packed_time([(512, 4000), (88, 0)]) > both


def _run(budget: int | None) -> Any:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml",
                       {"workers": {"prefill_token_budget": budget}} if budget else None)
    # Four prompts of 600 replayed tokens at token scale 16: 9,600 emulated each, a pass of
    # 8,192 (the h100's chunk) and a tail of 1,408; sent together.
    specs = [RequestSpec(f"q{i}", synth_tokens(f"pack-{i}", 600), 8, at=0.0) for i in range(4)]
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        return dep.run(TraceReplay(specs, 600, show_progress=False))


def test_a_prefill_packs_waiting_requests_into_fewer_passes_and_gives_the_same_tokens() -> None:
    alone, packed = _run(None), _run(16384)
    assert all(r.ok for r in [*alone.recs.values(), *packed.recs.values()])
    assert {k: list(r.tokens) for k, r in alone.recs.items()} == {k: list(r.tokens) for k, r in packed.recs.items()}
    steps = {name: run.workers["prefill"].device.by_kind["prefill"][0] for name, run in
             (("alone", alone), ("packed", packed))}
    # One at a time: a step a request (of two passes each). Packed (1,024 replayed tokens a pass):
    # 512 + 512, then the two tails (88 + 88) with the third's head (512) and the fourth's first
    # 336, then the rest (88 + 264): three passes in all, where one at a time took eight.
    assert steps == {"alone": 4, "packed": 3}, steps

    def ends(run: Any) -> list[float]:
        return sorted(e.end for r in run.router.values() for e in r.events if isinstance(e, PrefillDone))

    # The last prefill ends sooner when the passes are shared (one overhead and one read of the
    # weights per pass), and each request computed all of its prompt.
    assert ends(packed)[-1] < ends(alone)[-1]
    assert all(e.computed == 600 for r in packed.router.values() for e in r.events if isinstance(e, PrefillDone))


def test_requests_that_time_out_inside_packed_passes_leave_them_and_later_ones_are_served() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml", {"workers": {"prefill_token_budget": 8192,
                                                                "request_timeout_s": 0.5, "kv_transfer": "per-chunk"}})
    # Ten prompts of 600 replayed tokens at once (two passes each, ~0.25 emulated s, one token
    # out): those the router's sweep finds older than 0.5 s time out, queued or inside their
    # passes (their streamed transfers cut off); two more come once it has drained.
    specs = [RequestSpec(f"t{i}", synth_tokens(f"late-{i}", 600), 1, at=0.0) for i in range(10)]
    specs += [RequestSpec(f"u{i}", synth_tokens(f"after-{i}", 600), 1, at=5.0) for i in range(2)]
    with SimDeployment(sc, parse_policy("same-dc"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(specs, 600, show_progress=False))
    late = {k: r.error for k, r in run.recs.items() if not r.ok}
    assert len(late) >= 4 and all("timed out" in (why or "") for why in late.values()), late
    assert run.recs["u0"].ok and run.recs["u1"].ok  # the prefill went on
    pf = run.workers["prefill"].prefill
    assert pf is not None and pf.computed_tokens < 12 * 600  # what timed out in its passes was not finished
