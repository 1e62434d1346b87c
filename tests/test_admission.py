"""Bounded decoders (root): a request whose KV arrived at a full decoder waits, its first
token unsent, and joins when a request leaves; one that could never fit fails at once."""

from __future__ import annotations

from testbed.analysis.metrics import request_rows
from testbed.deploy.deployment import Deployment
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare
from testbed.policies import parse_policy
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model import ModelRunner, ensure_default_model

from .conftest import needs_root, scenario_with

pytestmark = needs_root


def test_a_full_decoder_queues_requests_and_their_first_token_waits() -> None:
    # Room for two requests of 60 + 80 tokens at a time (capacity), never more than 3 (batch).
    # Short prompts, long answers: the first two still decode when the fifth's KV arrives,
    # however slowly a loaded host prefills the five one after another.
    sc = scenario_with({"workers": {"max_batch": 3, "decode_kv_tokens": 300}})
    specs = [RequestSpec(f"q{i}", synth_tokens(f"adm-{i}", 60), 80, at=0.01 * i) for i in range(5)]
    big = RequestSpec("big", synth_tokens("adm-big", 280), 40, at=0.0)
    runner = ModelRunner(ensure_default_model(), "float32")
    refs = {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}
    with Deployment(sc, parse_policy("same-dc")) as dep:
        run = dep.run(TraceReplay([*specs, big], timeout_s=120))
    recs, router, stats = run.recs, run.router, run.workers
    assert recs["big"].error == "320 tokens of KV exceed decode-a's capacity of 300"
    assert compare(specs, refs, recs) == []
    counters = stats["decode-a"].decode
    assert counters is not None and counters.admission_waits >= 3 and counters.admission_queue_max >= 3
    df = request_rows(recs, router).set_index("rid")
    first = {rid: recs[rid].token_times[0] for rid in refs}
    last = {rid: recs[rid].token_times[-1] for rid in refs}
    # At most two requests stream at any moment: every first token comes after all but one
    # of the requests that started before it had finished.
    for rid in refs:
        streaming = [o for o in refs if o != rid and first[o] < first[rid] < last[o]]
        assert len(streaming) <= 1, (rid, streaming)
    # The wait is in TTFT: the last two admitted waited for earlier ones to finish.
    ttfts = sorted(df.loc[list(refs), "ttft_s"])
    assert ttfts[-1] > 2 * ttfts[0]
