"""Scenario validation and the network plan (no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.net.plan import make_plan
from testbed.scenario import Role, load_scenario

from .conftest import TOPOLOGIES

GOOD = (TOPOLOGIES / "two-dc.yaml").read_text()


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sc.yaml"
    p.write_text(text)
    return p


def test_default_scenario_loads() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    assert set(sc.datacenters) == {"a", "b"}
    assert sc.hosts_with_role(Role.PREFILL) == ["prefill"]
    assert sc.datacenter_of("decode-b") == "b"
    assert sc.wan_direction("a", "b").delay_ms == 15.0
    load_scenario(TOPOLOGIES / "bench-net.yaml")


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("delay_ms: 15.0, jitter_ms: 0.5, loss_pct: 0.0}   # a -> b",
         "delay_ms: -3, jitter_ms: 0.5, loss_pct: 0.0}   # a -> b", "wan.forward.delay_ms"),
        ("jitter_ms: 0.5, loss_pct: 0.0}   # b -> a", "jitter_ms: 40, loss_pct: 0.0}   # b -> a",
         "wan.reverse: jitter_ms must not exceed delay_ms"),
        ("relay:    {role: relay-decode, device: h100}", "relay:    {role: teapot, device: h100}",
         "datacenters.a.hosts.relay.role"),
        ("relay:    {role: relay-decode, device: h100}", "relay:    {role: relay-decode, gpu: 3}",
         "datacenters.a.hosts.relay.gpu"),
        ("relay:    {role: relay-decode, device: h100}", "relay:    {role: relay-decode, device: tpu}",
         "uses unknown device profile 'tpu'"),
        ("  model: qwen2.5-7b", "  model: llama-405b", "unknown model 'llama-405b'"),
        ("decode-b: {role: decode, device: h20}", "prefill: {role: decode}", "appears in datacenters"),
        ("subnet: 10.213.0.0/16", "subnet: 8.8.0.0/16", "network.subnet"),
        ("between: [a, b]", "between: [a, c]", "unknown datacenter 'c'"),
        ("loss_pct: 0.0}   # a -> b", "loss_pct: 100}   # a -> b", "wan.forward.loss_pct"),
        ("delay_ms: 15.0, jitter_ms: 0.5, loss_pct: 0.0}   # a -> b",
         "delay_ms: .inf, jitter_ms: 0.5, loss_pct: 0.0}   # a -> b", "wan.forward.delay_ms: Input should be a finite"),
        ("delay_ms: 15.0, jitter_ms: 0.5, loss_pct: 0.0}   # b -> a",
         "delay_ms: .nan, jitter_ms: 0.5, loss_pct: 0.0}   # b -> a", "wan.reverse.delay_ms: Input should be a finite"),
    ],
)
def test_bad_scenario_names_file_line_field(tmp_path: Path, old: str, new: str, expect: str) -> None:
    assert old in GOOD
    text = GOOD.replace(old, new)
    bad_line = next(i for i, line in enumerate(text.splitlines(), 1) if new.split("}")[0] in line)
    p = write(tmp_path, text)
    with pytest.raises(InputError) as ei:
        load_scenario(p)
    msg = str(ei.value)
    assert str(p) in msg and expect in msg
    if "." in expect.split(":")[0]:  # a field error points at the field's own line
        assert f"{p}:{bad_line}:" in msg, msg


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    p = write(tmp_path, "name: x\ndatacenters: {a: [\n")
    with pytest.raises(InputError, match=rf"{p}:\d+: invalid YAML"):
        load_scenario(p)


def test_yaml_nested_past_any_scenario_is_an_input_error(tmp_path: Path) -> None:
    p = write(tmp_path, "name: x\ndescription: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(InputError, match=rf"{p}: invalid YAML: nested too deeply"):
        load_scenario(p)


def test_missing_file() -> None:
    with pytest.raises(InputError, match="cannot read scenario"):
        load_scenario("/nonexistent/sc.yaml")


def test_plan_addresses_and_sizing() -> None:
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    plan = make_plan(sc, "pdd123abc")
    assert plan.hosts["client"].ip == "10.213.1.10"
    assert plan.hosts["decode-b"].ip == "10.213.2.10"
    assert plan.dcs["a"].gw_wan_ip == "10.213.0.1" and plan.dcs["b"].gw_wan_ip == "10.213.0.2"
    assert all(ns.startswith("pdd123abc-") for ns in plan.namespaces)
    s = plan.wan_shaping[("a", "b")]
    # Buffer = rate x RTT (31 ms incl. jitter) but at least 4 frames, burst = rate x 1 ms or 2 frames.
    rate = sc.wan.forward.rate_mbit * 1e6
    assert s.queue_bytes == pytest.approx(max(rate / 8 * 0.031, 4 * sc.network.mtu), rel=0.01)
    assert s.burst_bytes >= rate / 8 * 0.001
    assert s.burst_bytes >= 2 * sc.network.mtu


def test_a_model_path_that_is_no_usable_model_is_an_input_error(tmp_path: Path) -> None:
    missing = load_scenario(TOPOLOGIES / "two-dc.yaml", {"workers": {"model": str(tmp_path / "nope")}})
    with pytest.raises(InputError, match=r"workers.model: .*/nope is not a model directory \(no config.json\)"):
        missing.model_dir()
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text('{"vocab_size": 100}')
    tiny = load_scenario(TOPOLOGIES / "two-dc.yaml", {"workers": {"model": str(small)}})
    with pytest.raises(InputError, match=r"workers.model: .*config.json: not a model configuration \(missing "
                                         r"num_hidden_layers, num_attention_heads, hidden_size\)"):
        tiny.model_dir()
    (small / "config.json").write_text('{"vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 4, '
                                       '"hidden_size": 64}')
    with pytest.raises(InputError, match="has a vocabulary of 100 tokens; traces are synthesised from token ids below"):
        tiny.model_dir()


def test_a_scenario_extends_another_key_by_key(tmp_path: Path) -> None:
    base = (TOPOLOGIES / "two-dc.yaml").read_text()
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nname: child\nworkers: {kv_timeout_s: 300}\n"
                                         "faults: [kill@5:host=decode-b]\n")
    sc, parent = load_scenario(tmp_path / "child.yaml"), load_scenario(tmp_path / "base.yaml")
    assert sc.name == "child" and sc.workers.kv_timeout_s == 300 and len(sc.faults) == 1
    assert sc.workers.max_batch == parent.workers.max_batch and sc.datacenters == parent.datacenters
    (tmp_path / "base.yaml").write_text(base.replace("name: two-dc", "extends: child.yaml\nname: two-dc"))
    with pytest.raises(InputError, match="extends"):
        load_scenario(tmp_path / "child.yaml")
    (tmp_path / "child.yaml").write_text("extends: nowhere.yaml\nname: child\n")
    with pytest.raises(InputError, match="nowhere.yaml: cannot read scenario"):
        load_scenario(tmp_path / "child.yaml")
    # A model card named by the base is read from the base's folder, wherever the child lives.
    (tmp_path / "mine.yaml").write_text(f"extends: {TOPOLOGIES / 'prfaas.yaml'}\nname: mine\n")
    assert load_scenario(tmp_path / "mine.yaml").models["hybrid-1t"].linear_layers == 70
    assert load_scenario(Path("topologies/prfaas-homogeneous.yaml")).models["hybrid-1t"].linear_layers == 70


def test_the_pd_outage_scenario_is_the_papers_with_a_kill_and_long_timeouts() -> None:
    sc, paper = load_scenario(TOPOLOGIES / "pd-outage.yaml"), load_scenario(TOPOLOGIES / "paper.yaml")
    assert sc.datacenters == paper.datacenters and sc.costs == paper.costs
    assert sc.workers.kv_timeout_s == 300 and sc.workers.failure_detection == "probe"
    assert [(f.kind, f.host) for f in sc.faults] == [("kill", "decode-b1")]


def test_run_as_names_an_account_of_this_machine(tmp_path: Path) -> None:
    assert load_scenario(TOPOLOGIES / "two-dc.yaml").workers.run_as == "per-component"
    assert load_scenario(TOPOLOGIES / "two-dc.yaml", {"workers": {"run_as": "nobody"}}).workers.run_as == "nobody"
    assert load_scenario(TOPOLOGIES / "two-dc.yaml", {"workers": {"run_as": "root"}}).workers.run_as == "root"
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: " + str(TOPOLOGIES / "two-dc.yaml") + "\nworkers:\n  run_as: no-such-user\n")
    with pytest.raises(InputError, match=r"workers.run_as: .*no account 'no-such-user' on this machine"):
        load_scenario(bad)
