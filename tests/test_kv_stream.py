"""KV streamed as it is computed (``kv_transfer: per-chunk`` and ``per-layer``): the schedule of
a prefill's passes, the wire sending each frame once its tokens (its layers) are computed (and a
cut-off while it waits), both engines running it end to end with the reference tokens."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from protocol import clock
from protocol.messages import KvSent, PrefillDone
from protocol.worker_config import DeviceSpec, ModelCost, Scales
from testbed.deploy.deployment import Deployment
from testbed.deploy.emulation import EmulationPlan
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare
from testbed.policies import parse_policy
from testbed.traces.workload import RequestSpec, synth_tokens
from workers import kv_wire
from workers.device import make_pacer
from workers.kv_stream import Computed, LayerOrder, schedule
from workers.model import ModelRunner, ensure_default_model
from workers.model_dir import kv_bytes_per_token

from .conftest import ROOT, needs_root, run_cli, scenario_with

COST = ModelCost(params=7.61e9, layers=28, hidden=3584, kv_bytes_per_token=57344, weight_bytes=7.61e9 * 2)
DEV = DeviceSpec(name="gpu", peak_tflops=989, mem_gbps=3350, step_overhead_ms=2.0, prefill_chunk=8192)


def test_a_prefills_schedule_is_its_passes_in_replayed_tokens_ending_with_the_prefill() -> None:
    pacer = make_pacer(DEV, COST, Scales(s_in=16, s_out=16, dilation=2.0))
    passes = pacer.prefill_schedule(1300, 200)  # 20,800 emulated tokens: passes of 8,192, 8,192, 4,416
    assert [d for d, _ in passes] == [512, 1024, 1300]
    ends = [t for _, t in passes]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(pacer.prefill_time(1300, 200))
    # Each pass priced as the whole prefill prices it: the first of three passes, alone.
    assert ends[0] == pytest.approx(pacer.prefill_time(512, 200), rel=1e-9)
    c = schedule(100.0, 200, passes)
    assert c.due(150) == 100.0  # cached at the prefill: there at once
    assert c.due(201) == c.due(712) == 100.0 + ends[0] and c.due(713) == 100.0 + ends[1]
    assert c.due(1500) == 100.0 + ends[-1]
    assert c.ready(100.0) == 200 and c.ready(100.0 + ends[0]) == 712 and c.ready(1e9) == 1500
    assert make_pacer(DeviceSpec(name="native"), None).native  # a native device: no passes, all at once


def _stream(n: int, have: int, computed: Computed | None, cut_at: float | None = None) -> dict[str, Any]:
    """One transfer over loopback; when each frame was sent, from the sender's start."""
    kv = torch.randn(4, 2, 2, n, 64, dtype=torch.float32)

    async def main() -> dict[str, Any]:
        got: dict[str, Any] = {"arrivals": []}

        async def offer(rid: str, toks: list[int], ticket: str) -> int:
            return have

        async def done(inc: kv_wire.Incoming) -> None:
            got["inc"] = inc

        async def fail(rid: str, msg: str) -> None:
            got["fail"] = msg

        server = await kv_wire.serve_kv("127.0.0.1", 0, offer, done, fail)
        port = server.sockets[0].getsockname()[1]
        cancel = asyncio.Event()
        t0 = clock.monotonic()
        if cut_at is not None:
            asyncio.get_running_loop().call_later(cut_at, cancel.set)

        def progress(st: kv_wire.TransferStats) -> None:
            got["arrivals"].append((st.tokens_sent, clock.monotonic() - t0))

        try:
            c = None if computed is None else Computed(t0, computed.hit, computed.done, computed.at)
            got["st"] = await kv_wire.send_kv("127.0.0.1", port, "r1", list(range(n)), kv, 42, 16, cancel=cancel,
                                              on_progress=progress, frame_tokens=64, computed=c)
            got["took"] = clock.monotonic() - t0
        finally:
            await asyncio.sleep(0.05)
            server.close()
        got["kv"] = kv
        return got

    return asyncio.run(main())


def test_the_wire_sends_each_frame_once_its_tokens_are_computed() -> None:
    # 448 tokens, 64 cached at the receiver, 128 at the prefill; three passes ending at 0.2, 0.4, 0.6 s.
    passes = Computed(0.0, 128, (96, 224, 320), (0.2, 0.4, 0.6))
    got = _stream(448, 64, passes)
    st, inc = got["st"], got["inc"]
    assert not st.cancelled and torch.equal(inc.kv, got["kv"][:, :, :, 64:]) and st.tokens_sent == 384
    sent = dict(got["arrivals"])  # tokens sent -> when (frames of 64 tokens from token 64)
    assert sent[64] < 0.15  # tokens 64-127: cached at the prefill, sent at once
    assert 0.2 <= sent[128] < 0.35  # 128-191 need pass 1 (to token 224)
    assert 0.4 <= sent[192] < 0.55 and 0.4 <= sent[256] < 0.55  # 192-319 need pass 2 (to 352)
    assert 0.6 <= sent[320] < 0.75 and 0.6 <= sent[384] < 0.75  # the rest with the last pass
    assert got["took"] < 0.9
    # After the prefill: everything at once.
    assert _stream(448, 64, None)["took"] < 0.3


def test_a_transfer_cut_off_while_its_tokens_are_computed_ends_at_once() -> None:
    got = _stream(448, 0, Computed(0.0, 0, (64, 448), (0.1, 5.0)), cut_at=0.3)
    st = got["st"]
    assert st.cancelled and st.tokens_sent == 64 and got["took"] < 1.0
    assert "inc" not in got


def _one_long_request(tmp_path: Path, policies: str, capsys: pytest.CaptureFixture[str]) -> pd.DataFrame:
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 2400, "output_length": 32, "hash_ids": [1, 2, 3, 4, 5]}\n')
    out = tmp_path / "run"
    code, err = run_cli(["run", "--engine", "sim", "--scenario", str(ROOT / "topologies/paper.yaml"), "--trace",
                         str(trace), "--token-scale", "16", "--policies", policies, "--out", str(out)], capsys)
    assert code == 0, err[-3000:]
    return pd.read_csv(out / "requests.csv").set_index("policy")


def test_the_simulator_streams_a_long_prefills_kv_across_the_line_while_it_computes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    df = _one_long_request(tmp_path, "cross-dc,cross-dc:transfer=per-chunk,cross-dc:transfer=after-prefill", capsys)
    naive, streamed = df.loc["cross-dc"], df.loc["cross-dc:transfer=per-chunk"]
    assert df.ok.all() and (df.loc["cross-dc:transfer=after-prefill"].ttft_s == naive.ttft_s)  # the default
    # The same bytes leave, the transfer starts at the prefill's start, not its end (5 passes
    # of up to 8,192 emulated tokens: 2,400 x 16), and the first token comes sooner.
    assert streamed.wan_kv_bytes == naive.wan_kv_bytes and streamed.kv_tokens_sent == naive.kv_tokens_sent
    assert streamed.wan_start_s < 0.5 * naive.wan_start_s
    assert streamed.ttft_s < naive.ttft_s
    assert streamed.ttft_s >= naive.wan_start_s  # the decoder starts only once it holds all of the KV
    assert streamed.output_tokens == naive.output_tokens


@pytest.mark.serial  # real compute held to its modeled step times: no neighbour on the cores
@needs_root
@pytest.mark.parametrize("how", ["transfer=per-chunk,connections=4", "transfer=per-layer"])
def test_streamed_kv_from_packed_passes_over_real_sockets_gives_the_reference_tokens_through_pdd(how: str) -> None:
    # Passes of at most 128 emulated tokens (token scale 1), each request at most 64 of them
    # and each pass 50 ms of emulated overhead: two prompts of 600 and 650 tokens sent together
    # share ~11 passes, ~1.2 s of real time at D 2, far more than the real model's compute, so
    # that the first passes' KV is due long before a prefill ends. PDD relays every request
    # (relay_s=0): the KV streams to the relay and across the line, per pass over four TCP
    # connections each (kv_connections) or per layer group, and the relay hands over.
    sc = scenario_with({"devices": {"h100": {"prefill_chunk": 64, "step_overhead_ms": 50.0}},
                        "workers": {"prefill_token_budget": 128},
                        "datacenters": {"a": {"lan": {"rate_mbit": 400000}}, "b": {"lan": {"rate_mbit": 400000}}}},
                       emulated=True)
    plan = EmulationPlan.make(sc, 1, 2.0, kv_bytes_per_token(ensure_default_model(), "float64"))
    specs = [RequestSpec(f"s{i}", synth_tokens(f"stream-{i}", 600 + 50 * i), 24, at=0.0) for i in range(2)]
    runner = ModelRunner(ensure_default_model(), "float64")
    refs = {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}
    policy = f"pdd:relay_s=0,handoff=catch-up,threshold=4,{how}"
    with Deployment(sc, parse_policy(policy), emulation=plan, dtype="float64") as dep:
        run = dep.run(TraceReplay(specs, timeout_s=240))
    assert compare(specs, refs, run.recs) == []
    assert {r.pipeline for r in run.router.values()} == {"P-RLD-MD"}
    computed, early = [], []
    for rec in run.router.values():
        done = next(e for e in rec.events if isinstance(e, PrefillDone))
        sent = next(e for e in rec.events if isinstance(e, KvSent) and e.to == "decode-b")
        assert done.computed >= 600 and sent.tokens == done.computed  # nothing cached: all of it
        # Each transfer across the line began before its prefill ended; the first one long before
        # (the second takes its turn to that decoder once the first has sent all it had).
        assert sent.start < done.end, (sent, done)
        early.append(sent.start < done.end - 0.3 * (done.end - done.start))
        computed.append(done.computed)
    assert any(early)
    pf = run.workers["prefill"].prefill
    assert pf is not None and 0 < pf.packed_passes < sum(-(-n // 64) for n in computed)  # the two shared passes


def test_streamed_kv_from_packed_passes_under_a_heavy_prefill_ends(tmp_path: Path) -> None:
    """A pass's end is a float that a timer set for it may fall an ulp short of: a transfer that
    waited for that ulp again never let the simulator's clock move (this run hung at 0 of 12)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed", "run", "--engine", "sim", "--scenario",
                        str(ROOT / "topologies/paper-engines.yaml"), "--trace", str(ROOT / "traces/paper.jsonl"),
                        "--token-scale", "16", "--limit", "12", "--prefill-cost", "32", "--speed", "0.7925",
                        "--policies", "cross-dc", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_csv(out / "requests.csv")
    assert len(df) == 12 and df.ok.all()


# ------------------------------------------------------------------ per layer
def test_a_per_layer_order_is_pass_by_pass_then_group_by_group_each_due_its_share_of_the_pass() -> None:
    # Frames of 64 tokens from token 0, 64 cached at the prefill; two passes: to token 64 + 128
    # at 0.2 s, to 320 at 0.6 s; two layer groups.
    c = Computed(0.0, 64, (128, 256), (0.2, 0.6))
    order = LayerOrder(c, 0, 320, 64, 2)
    frames = [asyncio.run(order.get(j)) for j in range(10)]
    assert frames == [(0, 0), (1, 0),  # cached at the prefill: at once, both groups
                      (0, 64), (0, 128), (1, 64), (1, 128),  # pass 1 (tokens 64-191): group 0, then group 1
                      (0, 192), (0, 256), (1, 192), (1, 256)]  # pass 2 (the rest)
    assert asyncio.run(order.get(10)) is None and order.last(10)
    assert [order.due(f) for f in frames] == [0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.4, 0.4, 0.6, 0.6]


def test_packed_passes_announce_their_layer_groups_as_they_start() -> None:
    c = Computed(10.0, 0, final=False)
    order = LayerOrder(c, 0, 128, 64, 4)
    assert c.layer_due(64, 0, 4) is None  # no pass yet
    c.passing(64, 10.0, 11.0)  # the first pass: tokens to 64, from 10 s to 11 s
    assert [order.due(f) for f in [asyncio.run(order.get(j)) for j in range(4)]] == [10.25, 10.5, 10.75, None]
    c.passed(64, 11.2)  # the last group is there when the pass has ended (a little late here)
    assert c.layer_due(64, 3, 4) == 11.2


def test_the_wire_sends_a_passes_layer_groups_as_they_are_computed_over_two_connections() -> None:
    n, kv = 256, torch.randn(4, 2, 2, 256, 8, dtype=torch.float32)
    c = Computed(0.0, 0, (256,), (0.8,))  # one pass of 0.8 s: per chunk, nothing could leave before its end

    async def main() -> tuple[kv_wire.Incoming, list[tuple[int, float]], kv_wire.TransferStats]:
        got: list[kv_wire.Incoming] = []
        seen: list[tuple[int, float]] = []

        async def offer(rid: str, toks: list[int], ticket: str) -> int:
            return 0

        async def done(inc: kv_wire.Incoming) -> None:
            got.append(inc)

        async def fail(rid: str, msg: str) -> None:
            raise AssertionError(msg)

        server = await kv_wire.serve_kv("127.0.0.1", 0, offer, done, fail)
        port = server.sockets[0].getsockname()[1]
        t0 = clock.monotonic()
        computed = Computed(t0, 0, c.done, c.at)
        try:
            st = await kv_wire.send_kv(
                "127.0.0.1", port, "l", list(range(n)), kv, 1, 16, frame_tokens=64, computed=computed,
                layer_groups=4, connections=2,
                on_progress=lambda s: seen.append((s.payload_bytes, clock.monotonic() - t0)))
        finally:
            await asyncio.sleep(0.05)
            server.close()
        return got[0], seen, st

    inc, seen, st = asyncio.run(main())
    assert torch.equal(inc.kv, kv) and st.tokens_sent == n
    group = n * kv[:1].numel() // n * 4  # bytes of one layer group (one layer here) of all 256 tokens
    first_group_at = next(t for b, t in seen if b >= group)
    assert 0.2 <= first_group_at < 0.45  # a quarter of the way through the pass, not at its end
    assert max(t for _, t in seen) >= 0.8  # the last group waited for the pass's end


def test_the_simulator_streams_a_one_pass_prompt_per_layer_and_prices_the_wires_bytes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 6400, "output_length": 32,
                                 "hash_ids": list(range(1, 14))}) + "\n")
    out = tmp_path / "run"
    policies = "cross-dc:transfer=per-chunk,cross-dc:transfer=per-layer,cross-dc:transfer=per-layer,connections=4"
    code, err = run_cli(["run", "--engine", "sim", "--scenario", str(ROOT / "topologies/paper.yaml"), "--trace",
                         str(trace), "--token-scale", "16", "--prefill-cost", "32", "--policies", policies, "--out",
                         str(out)], capsys)
    assert code == 0, err[-3000:]
    df = pd.read_csv(out / "requests.csv").set_index("policy")
    chunk, layer = df.loc["cross-dc:transfer=per-chunk"], df.loc["cross-dc:transfer=per-layer"]
    four = df.loc["cross-dc:transfer=per-layer,connections=4"]
    assert df.ok.all() and (df.output_tokens == chunk.output_tokens).all()
    # 6,400 emulated tokens: one pass (~1.4 s at a prefill cost of x32; ~0.3 s of the line for its
    # KV). Per chunk the KV leaves at the pass's end; per layer three of four groups leave during
    # it, and the first token comes sooner by about three quarters of the transfer (0.28 s here).
    line_s = chunk.wan_kv_bytes * 8 / 44.6e6  # the paper line's wire rate at token scale 16
    assert chunk.ttft_s - layer.ttft_s > 0.5 * line_s, (chunk.ttft_s, layer.ttft_s, line_s)
    # Four groups: each frame's header four times; four connections: three AUTHs, JOINs and ENDs more.
    assert layer.wan_kv_bytes > chunk.wan_kv_bytes and four.wan_kv_bytes > layer.wan_kv_bytes
