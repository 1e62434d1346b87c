"""The 2026 model families in the model card (docs/models.md): mixtures of experts, latent
attention, hybrid linear and sliding-window attention. Their arithmetic, their errors, and
a hybrid request's fixed-size state on the KV wire (loopback, no root) priced alike by the
simulator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from protocol.kv_format import AUTH, HDR, HELLO, MAGIC, STATE, VERSION, Auth, End
from protocol.worker_config import Scales
from testbed.analysis.kv_rate import PRFAAS_GBPS, kv_rates, load_cards
from testbed.analysis.metrics import request_rows
from testbed.cli.main import main
from testbed.deploy.deployment import Deployment
from testbed.deploy.emulation import EmulationPlan
from testbed.errors import InputError
from testbed.experiments.model_whatif import WhatIfResult, with_card
from testbed.hardware import ModelCard
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare, verification_prompts
from testbed.policies import parse_policy
from testbed.scenario import load_scenario
from testbed.sim.engine import sim_plan
from testbed.sim.kv import block_frames_bytes, hello_bytes, state_frames_bytes
from workers import kv_wire
from workers.device import make_pacer
from workers.model import ModelRunner, ensure_default_model
from workers.model_dir import kv_bytes_per_token

from .conftest import needs_root, scenario_with

CARDS = sorted(Path("topologies/models").glob("*.yaml"))


def _card(name: str) -> ModelCard:
    return load_cards([Path(f"topologies/models/{name}.yaml")])[name]


def test_every_shipped_card_loads_and_its_kv_follows_its_attention() -> None:
    cards = load_cards(CARDS)
    assert len(cards) >= 9
    # Dense GQA: 2 x layers x kv_heads x head_dim x 2 B.
    assert cards["qwen2.5-7b"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 and cards["qwen2.5-7b"].state_bytes == 0
    # MLA: one latent and its RoPE key per layer.
    assert cards["deepseek-v3"].kv_bytes_per_token == 61 * (512 + 64) * 2
    # Hybrid linear: only the full layers grow with the context; the linear ones are a fixed state.
    nxt = cards["qwen3-next-80b-a3b"]
    assert nxt.full_layers == 12 and nxt.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2
    assert nxt.state_bytes == 36 * 2146304 and nxt.kv_bytes_for(1000) == 1000 * 24576 + 36 * 2146304
    # Sliding window: the window's KV is part of the state, at the window layers' own KV heads.
    mimo = cards["mimo-v2-flash"]
    assert mimo.kv_bytes_per_token == 8 * 4 * (192 + 128) * 2 and mimo.state_bytes == 40 * 128 * 8 * 320 * 2
    # The families differ by 10-20x in KV bytes per token, which is the question this testbed asks.
    assert cards["minimax-m2.5"].kv_bytes_per_token / cards["hybrid-1t"].kv_bytes_per_token > 20


def test_a_mixture_reads_the_experts_its_batch_touches() -> None:
    ds = _card("deepseek-v3")
    cost = ds.cost()
    assert cost.pass_weight_bytes(1) == pytest.approx(37e9 * 2)
    assert cost.pass_weight_bytes(2) > cost.pass_weight_bytes(1)
    assert cost.pass_weight_bytes(100_000) == pytest.approx(671e9 * 2, rel=1e-6)  # every expert
    # So a decode step at batch 64 reads more than a step at batch 1 (weights, not just KV).
    pacer = make_pacer(load_scenario("topologies/paper.yaml").devices["h200"].spec("h200", 8), cost, Scales())
    assert pacer.decode_emulated([1000] * 64) > 3 * pacer.decode_emulated([1000])


def test_a_dense_cards_cost_is_what_it_was() -> None:
    """The new fields have defaults that leave the dense model's pricing as it was."""
    cost = _card("qwen2.5-7b").cost()
    assert (cost.attention_layers, cost.window_layers, cost.state_bytes, cost.experts) == (None, 0, 0.0, 0)
    assert cost.pass_weight_bytes(4096) == cost.weight_bytes and cost.attention_flops(10, 100) == 4 * 28 * 3584 * 1000


def test_the_kv_rate_table_reads_the_cards_and_names_prfaas_figures() -> None:
    rates = {r.name: r for r in kv_rates(load_cards(CARDS), load_scenario("topologies/paper.yaml").devices["h200"],
                                         8, 32768)}
    assert set(PRFAAS_GBPS) <= set(rates)
    # The ordering PrfaaS reports (full GQA > MoE GQA > hybrids) holds in ours.
    order = sorted(PRFAAS_GBPS, key=lambda n: -rates[n].gbps)
    assert order[:2] == ["minimax-m2.5", "qwen3-235b-a22b"] and order[-1] == "hybrid-1t"
    # The implied time carries the reported rate back onto our bytes: KV bits over it.
    r = rates["minimax-m2.5"]
    assert r.reported_prefill_s == pytest.approx(r.kv_bytes * 8 / 59.93e9)
    assert r.gbps / PRFAAS_GBPS["minimax-m2.5"] == pytest.approx(r.reported_prefill_s / r.prefill_s)


@pytest.mark.parametrize(("text", "where"), [
    ("layers: 4\nheads: 4\nkv_heads: 2\nhead_dim: 64\nparams: 1e9\nlinear_layers: 4\nlinear_state_bytes: 8\n", ":1:"),
    ("layers: 4\nheads: 4\nkv_heads: 2\nhead_dim: 64\nparams: 1e9\nwindow: -3\n", ":6: window"),
    ("layers: 4\nheads: 4\nkv_heads: 2\nhead_dim: 64\nparams: 1e9\nexperts: 8\n", ":1:"),
])
def test_a_bad_card_file_is_refused_naming_its_file_line_and_field(tmp_path: Path, text: str, where: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"extends: {Path('topologies/paper.yaml').resolve()}\nmodels:\n  bad: bad.yaml\n"
                        "emulation:\n  model: bad\n")
    with pytest.raises(InputError) as e:
        load_scenario(scenario)
    assert f"bad.yaml{where}" in str(e.value)


def test_a_scenario_may_name_a_card_file_and_its_wire_carries_the_state() -> None:
    sc = load_scenario("topologies/paper-hybrid.yaml")
    assert sc.emulation is not None and sc.models[sc.emulation.model].linear_layers == 36
    plan = sim_plan(sc, 16)
    assert plan.state_wire_bytes == round(36 * 2146304 * plan.byte_factor) > 0


class _Rx:
    def __init__(self) -> None:
        self.done: list[kv_wire.Incoming] = []
        self.failed: dict[str, str] = {}

    async def offer(self, rid: str, tokens: list[int], ticket: str) -> int:
        return 0

    async def arrived(self, inc: kv_wire.Incoming) -> None:
        self.done.append(inc)

    async def fail(self, rid: str, why: str) -> None:
        self.failed[rid] = why


def _transfer(send_state: int, take_state: int) -> tuple[_Rx, kv_wire.TransferStats | str]:
    async def main() -> tuple[_Rx, kv_wire.TransferStats | str]:
        rx = _Rx()
        server = await kv_wire.serve_kv("127.0.0.1", 0, rx.offer, rx.arrived, rx.fail, timeout_s=5.0,
                                        state_bytes=take_state)
        port = server.sockets[0].getsockname()[1]
        kv = torch.zeros((2, 2, 2, 40, 4))
        try:
            st: kv_wire.TransferStats | str = await kv_wire.send_kv(
                "127.0.0.1", port, "r1", list(range(3, 43)), kv, 7, 16, timeout_s=5.0, state_bytes=send_state)
        except kv_wire.KVTransferError as e:
            st = str(e)
        await asyncio.sleep(0.05)
        server.close()
        return rx, st

    return asyncio.run(main())


def test_a_hybrid_transfer_carries_its_state_and_the_simulator_prices_the_same_bytes() -> None:
    state = 600_000  # three STATE frames
    rx, st = _transfer(state, state)
    assert isinstance(st, kv_wire.TransferStats) and not rx.failed and len(rx.done) == 1
    per_token = 2 * 2 * 2 * 4 * 4
    assert st.payload_bytes == st.planned_payload == 40 * per_token + state
    # The simulator's framing, frame for frame: AUTH, HELLO, BLOCKs, STATEs, END.
    sim = (HDR.size + len(Auth().model_dump_json())
           + hello_bytes("r1", list(range(3, 43)), (2, 2, 4), torch.float32, 16, "", "", state)
           + block_frames_bytes(40, per_token, 16) + state_frames_bytes(state)
           + HDR.size + len(End(first_token=7, n=40).model_dump_json()))
    assert st.bytes_sent == sim
    # A dense transfer's HELLO is what it was before states existed.
    _, dense = _transfer(0, 0)
    assert isinstance(dense, kv_wire.TransferStats) and dense.bytes_sent == sim - state_frames_bytes(state) - len(
        ',"state_bytes":600000')


def test_a_state_of_another_size_is_refused_with_the_reason() -> None:
    rx, st = _transfer(1000, 2000)
    assert isinstance(st, str) and "request state of 1000 bytes announced, this worker takes 2000" in st
    assert "r1" in rx.failed and not rx.done


def test_a_peer_that_sends_more_state_than_announced_fails_only_its_transfer() -> None:
    async def main() -> _Rx:
        rx = _Rx()
        server = await kv_wire.serve_kv("127.0.0.1", 0, rx.offer, rx.arrived, rx.fail, timeout_s=2.0,
                                        state_bytes=10)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        def frame(ftype: int, payload: bytes) -> bytes:
            return HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)) + payload

        writer.write(frame(AUTH, b'{"token": ""}'))
        hello = ('{"rid": "r9", "tokens": [5], "dtype": "torch.float32", "layers": 1, "kv_heads": 1, '
                 '"head_dim": 1, "block_size": 1, "state_bytes": 10}')
        writer.write(frame(HELLO, hello.encode()))
        await reader.read(100)  # the offer
        block = kv_wire.encode_block(0, 0, torch.zeros((1, 2, 1, 1, 1)))[0]
        writer.write(frame(kv_wire.BLOCK, block) + frame(STATE, bytes(64)))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        server.close()
        return rx

    rx = asyncio.run(main())
    assert "state 0 of 10" in rx.failed["r9"] and not rx.done


def test_whatif_runs_each_card_and_line_and_fewer_kv_bytes_cross_the_line(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "wi"
    assert main(["whatif", "--scenario", "topologies/paper.yaml", "--trace", "traces/agentic-quick.jsonl",
                 "--token-scale", "16", "--limit", "25", "--rates", "10",
                 "--cards", "topologies/models/minimax-m2.5.yaml", "topologies/models/hybrid-1t.yaml",
                 "--out", str(out)]) == 0
    r = WhatIfResult.model_validate_json((out / "whatif.json").read_text())
    rows = {row.card: row for row in r.rows}
    assert set(rows) == {"minimax-m2.5", "hybrid-1t"} and r.compute_of == "qwen2.5-7b"
    dense, hybrid = rows["minimax-m2.5"], rows["hybrid-1t"]
    assert dense.wan_kv_gb["same-dc"] == 0 and 0 < hybrid.wan_kv_gb["cross-dc"] < dense.wan_kv_gb["cross-dc"]
    assert dense.gap_p50_s is not None and hybrid.gap_p50_s is not None and hybrid.gap_p50_s < dense.gap_p50_s
    assert (out / "gap_vs_kv.png").stat().st_size > 0 and "| hybrid-1t | 10 |" in capsys.readouterr().out


def test_kv_of_keeps_the_models_compute_and_puts_the_other_cards_kv_on_the_line() -> None:
    sc = load_scenario(Path("topologies/paper.yaml"))
    own = EmulationPlan.make(sc, 16, 1.0, 1024)
    hybrid = _card("qwen3-next-80b-a3b")
    plan = EmulationPlan.make(with_card(sc, "qwen3-next-80b-a3b", hybrid, whole=False), 16, 1.0, 1024)
    a, b = own.cost(), plan.cost()
    assert a is not None and b is not None
    assert a == b  # every worker computes, reads and caches as the model's own
    assert plan.b_e == 24_576 and plan.state_wire_bytes == round(hybrid.state_bytes * 1024 / (16 * 24_576))
    assert "with the KV of qwen3-next-80b-a3b" in plan.describe(with_card(sc, "qwen3-next-80b-a3b", hybrid, False))
    whole = EmulationPlan.make(with_card(sc, "qwen3-next-80b-a3b", hybrid, whole=True), 16, 1.0, 1024).cost()
    assert whole is not None and whole.params == hybrid.compute_params != a.params
    bad = sc.model_dump(mode="python") | {"source": sc.source}
    bad["emulation"]["kv_of"] = "nope"
    with pytest.raises(ValueError, match="emulation.kv_of names unknown model 'nope'"):
        type(sc).model_validate(bad)


# A hybrid small enough that its state crosses in a blink: 2 linear layers of 64 KiB.
TINY_HYBRID = {"layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "params": 1e9,
               "linear_layers": 2, "linear_state_bytes": 65536}


@needs_root
def test_a_hybrid_cards_requests_give_the_reference_tokens_through_pdd_and_carry_the_state() -> None:
    specs = verification_prompts(8, seed=5, max_len=512)
    runner = ModelRunner(ensure_default_model(), "float64")
    refs = {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}
    sc = scenario_with({"models": {"tiny-hybrid": TINY_HYBRID},
                        "emulation": {"model": "tiny-hybrid", "time_dilation": 1}})
    plan = EmulationPlan.make(sc, 1, 1.0, kv_bytes_per_token(ensure_default_model(), "float64"))
    with Deployment(sc, parse_policy("pdd:relay_s=0"), emulation=plan, dtype="float64") as dep:
        states = {w.kv_state_bytes for w in dep.cluster.workers.values()}
        run = dep.run(TraceReplay(specs, timeout_s=120))
    [state] = states  # every worker sends and takes the same state
    assert state > 0
    assert compare(specs, refs, run.recs) == []
    df = request_rows(run.recs, run.router, specs)
    assert (df.pipeline == "P-RLD-MD").any() and (df.handoffs > 0).any()  # the relay and its handoff too
    crossed = df[(df.wan_kv_bytes > 0) & ~df.wan_cut_off.astype(bool)]  # a transfer cut off sends part of it
    assert len(crossed) > 0 and (crossed.wan_kv_bytes >= state).all()  # the state crossed with every transfer
