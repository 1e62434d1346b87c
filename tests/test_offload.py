"""Prefill offload: routing decisions (unit) and the tokens of an offloaded request (root)."""

from __future__ import annotations

import time
from typing import Any

from protocol.messages import KvReceived, KvSent
from testbed.analysis.cost import missing_for
from testbed.analysis.metrics import request_rows
from testbed.deploy.deployment import Deployment
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare, verification_prompts
from testbed.policies import make_policy, parse_policy
from testbed.policies.base import ClusterView, PolicyContext, RequestState, WorkerView
from testbed.scenario import load_scenario
from testbed.traces.workload import synth_tokens
from workers.model import ModelRunner, ensure_default_model

from .conftest import TOPOLOGIES, needs_root, scenario_with


def _cluster(remote: bool = True) -> ClusterView:
    ws = [WorkerView("prefill", "prefill", "a", "x", 1), WorkerView("decode-a", "decode", "a", "x", 1),
          WorkerView("decode-b", "decode", "b", "x", 1)]
    if remote:
        ws.append(WorkerView("prefill-b", "prefill", "b", "x", 1))
    for w in ws:
        w.up = True
    return ClusterView({w.name: w for w in ws})


def _policy(spec: str, token_scale: int = 1) -> Any:
    p = make_policy(parse_policy(spec))
    p.bind(PolicyContext(wan_rate_bps=1e9, wan_back_rate_bps=100e6, wan_rtt_s=0.03, kv_bytes_per_token=4096,
                         block_size=16, decode_cache_tokens=100_000, home_dc="a", token_scale=token_scale))
    return p


def _req(rid: str, prompt: list[int]) -> RequestState:
    return RequestState(rid, prompt, 16, time.time())


def test_long_uncached_prefills_go_away_short_or_cached_ones_stay_home() -> None:
    pol, cl = _policy("prefill-offload:threshold=1000,wan_s=5"), _cluster()
    short = pol.plan(_req("s", synth_tokens("s", 500)), cl)
    assert (short.pipeline, short.prefill, short.decode) == ("P-D(a)", "prefill", "decode-a")
    long = _req("l", synth_tokens("l", 2000))
    long.plan = pol.plan(long, cl)
    assert (long.plan.pipeline, long.plan.prefill, long.plan.decode) == ("P(b)-D(a)", "prefill-b", "decode-a")
    assert long.plan.info.delta_tokens == 2000  # the local decoder lacks the whole prompt
    pol.on_event(long, KvSent(rid="l", worker="prefill-b", t=1.0, to="decode-a", bytes=0, written=0, payload=0,
                              planned_payload=0, tokens=0, had=0, start=0.0, end=0.7))
    pol.on_event(long, KvReceived(rid="l", worker="decode-a", t=1.0, bytes=0, had=0, start=0.0, end=0.7))
    # The local prefill has computed none of it: a second long turn of that session is offloaded
    # again, and only what the local decoder lacks crosses the line.
    again = pol.plan(_req("l2", synth_tokens("l", 2000) + synth_tokens("more", 40)), cl)
    assert again.prefill == "prefill-b" and again.info.delta_tokens == 40
    # What the local prefill holds is not uncached.
    pol.plan(_req("h", synth_tokens("home", 500)), cl)
    home = pol.plan(_req("h2", synth_tokens("home", 500) + synth_tokens("x", 600)), cl)
    assert home.prefill == "prefill"
    assert pol.stats().counts == {"local": 3, "offloaded": 2}


def test_options_are_emulated_tokens_and_a_busy_line_or_no_pool_keeps_prefill_home() -> None:
    scaled = _policy("prefill-offload:threshold=1000,wan_s=5", token_scale=16)
    assert scaled.plan(_req("s", synth_tokens("s", 100)), _cluster()).prefill == "prefill-b"  # 1,600 emulated
    busy, cl = _policy("prefill-offload:threshold=1000,wan_s=0.5"), _cluster()
    first = busy.plan(_req("a", synth_tokens("a", 1200)), cl)  # 4.9 MB: 0.4 s at 100 Mbit/s back
    assert first.prefill == "prefill-b"
    assert busy.plan(_req("b", synth_tokens("b", 1200)), cl).prefill == "prefill"  # behind the first
    alone = _policy("prefill-offload:threshold=0")
    assert alone.plan(_req("c", synth_tokens("c", 10)), _cluster(remote=False)).prefill == "prefill"
    assert busy.stats().counts == {"offloaded": 1, "local (line busy)": 1, "local": 1}
    assert alone.stats().counts == {"local (no remote prefill)": 1, "local": 1}


def test_a_pool_away_busier_than_home_keeps_the_prefill_home_unless_balance_is_off() -> None:
    cl = _cluster()
    cl.workers["prefill-b"].assigned = 3  # three offloaded prefills still in flight away
    cl.workers["prefill"].assigned = 2
    pol = _policy("prefill-offload:threshold=1000,wan_s=5")
    assert pol.plan(_req("a", synth_tokens("a", 2000)), cl).prefill == "prefill"
    assert pol.stats().counts == {"local (away busier)": 1, "local": 1}
    cl.workers["prefill"].assigned = 3  # as busy: away takes it
    assert pol.plan(_req("b", synth_tokens("b", 2000)), cl).prefill == "prefill-b"
    cl.workers["prefill"].assigned = 0
    blind = _policy("prefill-offload:threshold=1000,wan_s=5,balance=false")
    assert blind.plan(_req("c", synth_tokens("c", 2000)), cl).prefill == "prefill-b"
    # Unlike devices: requests in flight per unit of prefill compute. Three on a pool 8x the
    # home instance's compute wait less than one at home.
    cl.workers["prefill"].assigned, cl.workers["prefill"].tflops = 1, 72.0
    cl.workers["prefill-b"].tflops = 8 * 72.0
    assert pol.plan(_req("d", synth_tokens("d", 2000)), cl).prefill == "prefill-b"
    cl.workers["prefill-b"].tflops = 72.0  # like devices: by count, as above
    assert pol.plan(_req("e", synth_tokens("e", 2000)), cl).prefill == "prefill"


def test_a_scenario_without_a_remote_prefill_pool_is_refused_for_offload() -> None:
    offload = make_policy(parse_policy("prefill-offload"))
    assert missing_for(load_scenario(TOPOLOGIES / "two-dc.yaml"), offload) == [
        "a prefill instance outside datacenter a"]
    assert missing_for(load_scenario(TOPOLOGIES / "offload.yaml"), offload) == []
    assert missing_for(load_scenario(TOPOLOGIES / "two-dc.yaml"), make_policy(parse_policy("pdd"))) == []


@needs_root
def test_offloaded_and_local_prefills_give_the_reference_tokens() -> None:
    """Prompts of at least 512 tokens are prefilled in datacenter b, the rest at home."""
    specs = verification_prompts(12, seed=13)
    runner = ModelRunner(ensure_default_model(), "float64")
    refs = {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}
    sc = scenario_with(base="offload.yaml")
    with Deployment(sc, parse_policy("prefill-offload:threshold=512"), dtype="float64") as dep:
        run = dep.run(TraceReplay(specs))
    assert compare(specs, refs, run.recs) == []
    df = request_rows(run.recs, run.router)
    away = df.pipeline == "P(b)-D(a)"
    assert set(df.pipeline) == {"P(b)-D(a)", "P-D(a)"}
    assert (df.wan_kv_bytes[away] > 0).all() and (df.wan_kv_bytes[~away] == 0).all()
    long = {s.rid for s in specs if len(s.prompt) >= 512}
    assert set(df.rid[away]) <= long


def test_a_hybrid_models_shared_head_is_uncached_at_the_local_prefill() -> None:
    """A hybrid prefill resumes only where an earlier prompt ended: a long prompt that shares
    a head with one sent before, then diverges, is all uncached (offloaded); with a dense
    model the head counts as cached (kept home)."""
    head = synth_tokens("system", 512)
    for exact, where in ((False, "prefill"), (True, "prefill-b")):
        pol = make_policy(parse_policy("prefill-offload:threshold=1000,wan_s=5"))
        pol.bind(PolicyContext(wan_rate_bps=1e9, wan_back_rate_bps=1e9, wan_rtt_s=0.03, kv_bytes_per_token=4096,
                               block_size=16, decode_cache_tokens=100_000, home_dc="a",
                               prefill_exact_states=exact))
        cl = _cluster()
        assert pol.plan(_req("first", head + synth_tokens("q1", 100)), cl).prefill == "prefill"  # short: home
        # 1,112 tokens: 600 beyond the head (home), or all of them (away)
        assert pol.plan(_req("second", head + synth_tokens("q2", 600)), cl).prefill == where
