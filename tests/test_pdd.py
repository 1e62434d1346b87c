"""PDD: routing decisions (unit) and relay -> main decoder handoffs end to end (root)."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import pytest
import torch

from protocol.messages import HandoffCmd, KvReceived, KvSent, PrefillDone, RequestHints
from testbed.analysis.metrics import request_rows
from testbed.deploy.deployment import Deployment
from testbed.deploy.run_record import ClientRecord
from testbed.errors import InputError
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare
from testbed.net import netns
from testbed.policies import make_policy, parse_policy
from testbed.policies.base import ClusterView, PolicyContext, RequestState, WorkerView
from testbed.policies.prefix_index import PrefixIndex
from testbed.policies.wan import WanEstimator
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model import ModelRunner, ensure_default_model

from .conftest import needs_root, scenario_with

N = 16  # catch-up batch in the end-to-end tests


# ------------------------------------------------------------------------- unit: routing
def _cluster() -> ClusterView:
    ws = [WorkerView("prefill", "prefill", "a", "10.0.0.1", 1), WorkerView("relay", "relay-decode", "a", "x", 1),
          WorkerView("decode-a", "decode", "a", "x", 1), WorkerView("decode-b", "decode", "b", "x", 1)]
    for w in ws:
        w.up = True
    return ClusterView({w.name: w for w in ws})


def _pdd(spec: str) -> Any:
    p = make_policy(parse_policy(spec))
    p.bind(PolicyContext(wan_rate_bps=100e6, wan_rtt_s=0.03, kv_bytes_per_token=4096, block_size=16,
                         decode_cache_tokens=100_000))
    return p


def _req(rid: str, prompt: list[int], **hints: Any) -> RequestState:
    return RequestState(rid, prompt, 16, time.time(), RequestHints(**hints))


def _kv_sent(rid: str, to: str, start: float, end: float) -> KvSent:
    return KvSent(rid=rid, worker="prefill", t=end, to=to, bytes=0, written=0, payload=0, planned_payload=0,
                  tokens=0, had=0, start=start, end=end)


def _kv_received(rid: str, worker: str) -> KvReceived:
    return KvReceived(rid=rid, worker=worker, t=time.time(), bytes=0, had=0, start=0.0, end=0.0)


def test_routing_small_delta_goes_p_md_large_delta_goes_through_the_relay() -> None:
    pol, cl = _pdd("pdd"), _cluster()
    head = synth_tokens("shared", 2000)
    r1 = _req("r1", head + synth_tokens("a", 48))  # 8 MB to cross at 100 Mbit/s
    r1.plan = pol.plan(r1, cl)
    assert (r1.plan.pipeline, r1.plan.relay, r1.plan.decode) == ("P-RLD-MD", "relay", "decode-b")
    pol.on_event(r1, _kv_sent("r1", "decode-b", 0.0, 0.7))
    # Until the MD reports the KV in place, the router does not count on its cache.
    assert pol.plan(_req("r2", head + synth_tokens("b", 48)), cl).pipeline == "P-RLD-MD"
    pol.wan.inflight.clear()
    pol.on_event(r1, _kv_received("r1", "decode-b"))
    r3 = pol.plan(_req("r3", head + synth_tokens("c", 48)), cl)  # the MD has the 2000-token head
    assert r3.pipeline == "P-MD" and r3.relay is None
    assert r3.info.md_have_tokens == 2000 and r3.info.delta_tokens == 48
    # Without a decode-side cache the MD lacks everything, so the same request is relayed.
    nodrc = _pdd("pdd:drc=off")
    r1.plan = nodrc.plan(r1, cl)
    nodrc.on_event(r1, _kv_received("r1", "decode-b"))
    nodrc.wan.inflight.clear()
    assert nodrc.plan(_req("r3", head + synth_tokens("c", 48)), cl).pipeline == "P-RLD-MD"


def test_routing_counts_the_wan_backlog() -> None:
    pol, cl = _pdd("pdd:relay_s=0.2"), _cluster()
    small = synth_tokens("s", 200)  # 0.8 MB: ~0.1 s alone at 100 Mbit/s
    assert pol.plan(_req("a", small), cl).pipeline == "P-MD"
    big = synth_tokens("big", 4000)
    assert pol.plan(_req("b", big), cl).pipeline == "P-RLD-MD"
    # The big transfer is still queued: a small request now waits behind it.
    assert pol.plan(_req("c", synth_tokens("s2", 200)), cl).pipeline == "P-RLD-MD"


def test_a_request_the_router_fails_itself_leaves_no_transfer_in_the_wan_backlog() -> None:
    pol, cl = _pdd("pdd:relay_s=0.2"), _cluster()
    big = _req("b", synth_tokens("big", 4000))  # 16 MB: ~1.3 s at 100 Mbit/s
    big.plan = pol.plan(big, cl)
    assert pol.wan.inflight and pol.wan.backlog_bytes() > 0
    pol.on_end(big, "timed out after 600 s")  # no KvSent or Failed event will come
    assert not pol.wan.inflight and pol.wan.backlog_bytes() == 0
    # A completed request keeps its entry until its KvSent arrives (it may come after Done).
    done = _req("d", synth_tokens("big2", 4000))
    done.plan = pol.plan(done, cl)
    pol.on_end(done, None)
    assert "d" in pol.wan.inflight
    pol.on_event(done, _kv_sent("d", done.plan.decode, 0.0, 1.0))
    assert not pol.wan.inflight


def test_filter_predict_keeps_flagged_low_hit_requests_on_the_relay() -> None:
    pol, cl = _pdd("pdd:filter=predict"), _cluster()
    plan = pol.plan(_req("x", synth_tokens("doc", 3000), short_output=True), cl)
    assert plan.pipeline == "P-RLD" and plan.decode == "relay" and plan.relay is None
    assert pol.plan(_req("y", synth_tokens("doc2", 3000)), cl).pipeline == "P-RLD-MD"  # not flagged
    assert pol.stats().counts["P-RLD (filtered)"] == 1


def test_adaptive_handoff_follows_relay_load() -> None:
    pol, cl = _pdd("pdd:handoff=adaptive,load=3,threshold=32"), _cluster()
    req = _req("r", synth_tokens("p", 3000))
    req.plan = pol.plan(req, cl)
    cl.workers["relay"].assigned = 1
    assert pol.handoff(req, cl) == HandoffCmd(rid="r", mode="catch-up", batch=32)
    cl.workers["relay"].assigned = 3
    assert pol.handoff(req, cl) == HandoffCmd(rid="r", mode="one-shot", batch=32)


def test_cut_off_only_anomalous_requests_by_default() -> None:
    def finished_on_rld(pol: Any, computed: int, **hints: Any) -> bool:
        req = _req("r", synth_tokens("p", 1000), **hints)
        req.events = [PrefillDone(rid="r", worker="prefill", t=0.0, computed=computed, hit_tokens=1000 - computed,
                                  first_token=5, start=0.0, end=0.1, real_s=0.1)]
        return pol.cut_off(req)

    pol = _pdd("pdd")
    assert finished_on_rld(pol, computed=900)  # fresh content: its KV would cross for nothing
    assert finished_on_rld(pol, computed=50, short_output=True)  # flagged by the trace
    assert not finished_on_rld(pol, computed=50)  # a session's history: let it land in the MD cache
    assert finished_on_rld(_pdd("pdd:cutoff=all"), computed=50)
    assert not finished_on_rld(_pdd("pdd:cutoff=off"), computed=900)
    assert finished_on_rld(_pdd("pdd:drc=off"), computed=50)  # no MD cache to keep it in


def test_bad_policy_options_are_rejected() -> None:
    for spec, msg in [("pdd:handoff=sideways", "option handoff='sideways': Input should be 'one-shot'"),
                      ("pdd:threshold=0", "option threshold='0': Input should be greater than or equal to 1"),
                      ("pdd:drc=maybe", "option drc='maybe': Input should be 'on' or 'off'"),
                      ("pdd:bogus=1", "unknown option 'bogus' \\(options: handoff, threshold"),
                      ("same-dc:x=1", "unknown option 'x' \\(options: transfer, connections\\)"),
                      ("pdx", "unknown policy 'pdx' \\(known: .*pdd, prefill-offload.*; a plugin"),
                      ("pdd:threshold", "option 'threshold' must be key=value")]:
        with pytest.raises(InputError, match=msg):
            parse_policy(spec)


def test_prefix_index_and_wan_estimator() -> None:
    idx = PrefixIndex(block_size=4, capacity_tokens=8)
    idx.insert(list(range(10)))  # two full blocks
    assert idx.match(list(range(12))) == 8 and idx.match([9, 9, 9, 9]) == 0
    idx.insert([7] * 8)  # evicts the least recently used blocks
    assert len(idx) == 2 and idx.match(list(range(12))) == 0
    # A look refreshes nothing: only the worker that gets a prompt uses its blocks (insert).
    idx = PrefixIndex(block_size=4, capacity_tokens=8)
    idx.insert([1] * 4)
    idx.insert([2] * 4)
    assert idx.match([1] * 4) == 4  # looked at, not used
    idx.insert([3] * 4)  # the least recently used goes: [1], in spite of the look
    assert idx.match([1] * 4) == 0 and idx.match([2] * 4) == 4
    wan = WanEstimator(rate_bps=80e6)  # 10 MB/s
    assert wan.wait_s(10_000_000, now=0.0) == pytest.approx(1.0)
    wan.started("a", 10_000_000, now=0.0)
    assert wan.wait_s(10_000_000, now=0.5) == pytest.approx(1.5)  # half of "a" still queued
    wan.finished("a", observed_s=2.0)  # took twice as long as predicted: the line is slower
    assert wan.efficiency < 1.0 and not wan.inflight
    # A transfer whose end never comes is forgotten: it no longer drains the newer ones.
    wan = WanEstimator(rate_bps=80e6)
    wan.started("lost", 10_000_000, now=0.0)
    wan.started("b", 10_000_000, now=400.0)
    assert wan.backlog_bytes(now=400.0) == pytest.approx(10_000_000) and list(wan.inflight) == ["b"]


def test_extend_recomputes_exactly_what_step_by_step_decode_produced() -> None:
    runner = ModelRunner(ensure_default_model(), "float64")
    prompt = synth_tokens("ext", 300)
    kv, first = runner.prefill(prompt, None, 128)
    toks, kv_step = [first], kv
    for _ in range(20):
        [(new, nxt)] = runner.decode_step([(kv_step, toks[-1])])
        kv_step = torch.cat([kv_step, new], dim=3)
        toks.append(nxt)
    ext_kv, preds = runner.extend(kv, toks[:-1])
    assert preds == toks[1:]
    assert torch.allclose(torch.cat([kv, ext_kv], dim=3), kv_step, atol=1e-12)


# ------------------------------------------------------------------------- end to end
def _refs(specs: list[RequestSpec]) -> dict[str, list[int]]:
    runner = ModelRunner(ensure_default_model(), "float64")
    return {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}


def _serve(policy: str, specs: list[RequestSpec], overrides: dict[str, Any] | None = None,
           after: Any = None) -> tuple[dict[str, ClientRecord], pd.DataFrame, dict[str, Any], Any]:
    sc = scenario_with(overrides)
    load = _ReplayThen(specs, after)
    with Deployment(sc, parse_policy(policy), dtype="float64") as dep:
        run = dep.run(load)
    stats = {"workers": run.workers, "policy": run.policy}
    return run.recs, request_rows(run.recs, run.router, specs).set_index("rid"), stats, load.extra


class _ReplayThen(TraceReplay):
    """A replay, then ``after(net)`` on the live network (what a test measures there)."""

    def __init__(self, specs: list[RequestSpec], after: Any) -> None:
        super().__init__(specs, timeout_s=120)
        self.after, self.extra = after, None

    def drive(self, dep: Deployment, begin: Any) -> tuple[list[RequestSpec], dict[str, ClientRecord]]:
        out = super().drive(dep, begin)
        self.extra = self.after(dep.net) if self.after else None
        return out


def _budget_specs(tag: str, out: int = 40) -> list[RequestSpec]:
    """Requests whose handoff starts after 0, 1, N-1, N, N+1 and 3N eager tokens (and one free)."""
    budgets = [0, 1, N - 1, N, N + 1, 3 * N, None]
    specs = []
    for i, b in enumerate(budgets):
        n_out = 3 * out if b == 3 * N else out  # room for several catch-up rounds
        specs.append(RequestSpec(f"{tag}{i}", synth_tokens(f"{tag}-{i}", 100 + 37 * i), n_out, at=0.15 * i,
                                 hints=RequestHints(eager=b)))
    return specs


def _check_stream(recs: dict[str, ClientRecord], specs: list[RequestSpec], refs: dict[str, list[int]]) -> None:
    assert compare(specs, refs, recs) == []
    for r in recs.values():
        assert r.ok, r.error
        assert list(r.token_times) == sorted(r.token_times)  # one ordered stream, timestamps non-decreasing


@needs_root
@pytest.mark.parametrize("mode", ["one-shot", "catch-up", "adaptive"])
def test_handoff_tokens_equal_reference_for_every_eager_count(mode: str) -> None:
    specs = _budget_specs(mode[0])
    refs = _refs(specs)
    recs, df, stats, _ = _serve(f"pdd:handoff={mode},threshold={N},load=3,relay_s=0", specs)
    _check_stream(recs, specs, refs)
    assert (df.pipeline == "P-RLD-MD").all()
    for s in specs:
        row = df.loc[s.rid]
        budget = s.hints.eager
        sizes = [int(x) for x in row.handoff_sizes.split("+")] if row.handoff_sizes else []
        assert row.handoff_mismatches == 0
        if budget is None:
            continue
        if mode == "one-shot":
            assert row.eager_tokens == budget and sizes == [budget], (s.rid, row.eager_tokens, sizes)
        else:
            assert row.eager_tokens >= budget
            # Batches of at most N; only a final batch sent because a round made no progress may be larger.
            assert all(x <= N for x in sizes[:-1])
            if row.eager_tokens < row.output_tokens:  # handed over: the MD got every eager token
                assert sum(sizes) == row.eager_tokens
            else:  # the relay finished first; what it had handed over is discarded
                assert sum(sizes) <= row.eager_tokens
        assert row.output_tokens == len(refs[s.rid])
        assert row.rld_share == pytest.approx(row.eager_tokens / row.output_tokens)
        if row.eager_tokens < row.output_tokens:  # handed over (a relay that finished first has no handoff time)
            assert row.md_kv_to_handoff_s >= 0
    if mode == "catch-up":  # 3N eager tokens cannot go in one batch of N
        assert len(df.loc[f"{mode[0]}5"].handoff_sizes.split("+")) >= 2
    md = stats["workers"]["decode-b"]
    handed_over = int((df.eager_tokens < df.output_tokens).sum())
    assert handed_over >= len(specs) - 2  # all but (at most) a request the relay finished first
    assert md.decode is not None
    assert md.decode.extend_mismatches == 0 and md.decode.extends_done >= handed_over


def _iface_tx_bytes(ns: str) -> int:
    with netns.iproute(ns) as ipr:
        for link in ipr.get_links():
            if link.get_attr("IFLA_IFNAME") != "lo":
                return int(link.get_attr("IFLA_STATS64")["tx_bytes"])
    raise AssertionError("no interface")


@needs_root
def test_relay_finishing_first_cuts_the_wan_transfer_off() -> None:
    # A slow WAN: the MD's 1800-token KV (14 MB in float64) needs ~6 s; the relay needs
    # a few steps for 3 tokens, so it finishes first and the WAN transfer is cut off.
    slow = {"wan": {"forward": {"rate_mbit": 20, "delay_ms": 15.0}, "reverse": {"rate_mbit": 20, "delay_ms": 15.0}}}
    specs = [RequestSpec("c0", synth_tokens("cut", 1800), 3)]
    refs = _refs(specs)

    def counter(net: Any) -> tuple[int, int]:
        time.sleep(0.5)
        c1 = _iface_tx_bytes(net.ns_of("prefill"))
        time.sleep(1.0)
        return c1, _iface_tx_bytes(net.ns_of("prefill"))

    recs, df, _, (c1, c2) = _serve("pdd:relay_s=0", specs, slow, after=counter)
    _check_stream(recs, specs, refs)
    row = df.loc["c0"]
    assert row.pipeline == "P-RLD-MD" and row.eager_tokens == 3 and row.handoffs == 0
    assert row.wan_cut_off and 0 < row.wan_kv_bytes < 0.5 * row.wan_kv_cancelled_bytes
    # What the sender's kernel had put out unacknowledged when cut: crossing while the reset
    # came, beyond the acknowledged bytes the table counts.
    assert 0 < row.wan_kv_in_flight_bytes < row.wan_kv_cancelled_bytes
    assert c2 - c1 < 100_000, f"{c2 - c1} bytes left the prefill host after the cut-off"


@needs_root
def test_drc_off_md_caches_nothing_and_routing_uses_what_md_lacks() -> None:
    slow = {"wan": {"forward": {"rate_mbit": 50, "delay_ms": 15.0}, "reverse": {"rate_mbit": 50, "delay_ms": 15.0}}}
    head = synth_tokens("drc-head", 600)  # 4.9 MB in float64: ~0.8 s at 50 Mbit/s
    # d0 long enough for the MD to take over: its KV takes ~0.8 s to cross, 400 tokens on the
    # relay (unpaced, float64) take about twice that.
    specs = [RequestSpec("d0", head + synth_tokens("d0", 40), 400, at=0.0),
             RequestSpec("d1", head + synth_tokens("d1", 40), 12, at=4.0)]
    refs = _refs(specs)
    on_recs, on, on_stats, _ = _serve("pdd", specs, slow)
    off_recs, off, off_stats, _ = _serve("pdd:drc=off", specs, slow)
    _check_stream(on_recs, specs, refs)
    _check_stream(off_recs, specs, refs)
    # With DRC the second request's delta is small: P-MD, little WAN traffic.
    assert list(on.pipeline) == ["P-RLD-MD", "P-MD"]
    assert on.loc["d0"].eager_tokens < 400  # the MD took d0 over, so it holds d0's prompt
    assert on.loc["d1"].plan_md_have_tokens >= 592 and on.loc["d1"].wan_kv_bytes < 0.2 * on.loc["d0"].wan_kv_bytes
    assert on_stats["workers"]["decode-b"].cache.hit_tokens > 0
    # Without it the MD lacks everything every time, so both go through the relay.
    assert list(off.pipeline) == ["P-RLD-MD", "P-RLD-MD"]
    assert off.loc["d1"].plan_md_have_tokens == 0
    assert off_stats["workers"]["decode-b"].cache.hit_tokens == 0


def test_kv_kept_off_the_wan_by_a_cut_off_in_the_queue_or_mid_transfer() -> None:
    from testbed.analysis.metrics import _kept_off

    queued = _kv_sent("q", "decode-b", 1.0, 1.0).model_copy(update={"cancelled": True})
    assert _kept_off(queued, 5000) == 5000  # never started: the router's planned delta stands in
    # HELLO on the line, no answer yet: nothing of the KV went either (a relay that finished
    # within one round trip; this test's live twin hit it one run in three).
    hello = queued.model_copy(update={"written": 9000, "bytes": 1})
    assert _kept_off(hello, 5000) == 5000
    mid = queued.model_copy(update={"written": 3000, "payload": 2900, "bytes": 3000, "planned_payload": 8000})
    assert _kept_off(mid, 5000) == 5100  # what the receiver lacked minus what crossed
    # Written into the socket but reset before it crossed: only the acknowledged bytes count.
    buffered = mid.model_copy(update={"written": 8100, "payload": 8000, "bytes": 1200})
    assert _kept_off(buffered, 5000) == 6800
