"""End-to-end pipelines on the emulated network (root): exact tokens, failures end requests."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from protocol.worker_config import WorkerFaults
from testbed.analysis.metrics import request_rows
from testbed.deploy.deployment import Deployment
from testbed.deploy.run_record import ClientRecord
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare, verification_prompts
from testbed.policies import parse_policy
from testbed.traces.workload import RequestSpec, synth_tokens
from workers.model import ModelRunner, ensure_default_model
from workers.privilege import Identity

from .conftest import assert_unprivileged, needs_root, scenario_with

pytestmark = needs_root


@pytest.fixture(scope="module")
def prompts_and_refs() -> tuple[list[RequestSpec], dict[str, list[int]]]:
    specs = verification_prompts(20, seed=11)
    runner = ModelRunner(ensure_default_model(), "float64")
    return specs, {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}


class UnprivilegedCheck(TraceReplay):
    """A replay that checks, once the router is ready and before the first request, that
    everything parsing network input runs without root, each component as its own account
    (``workers.run_as``: per-component)."""

    def drive(self, dep: Deployment, begin: Callable[[float], None]) -> tuple[list[RequestSpec],
                                                                            dict[str, ClientRecord]]:
        def checked(t0: float) -> None:
            cl = dep.cluster
            parsers = {name: pid for name, pid in dep.processes()
                       if name in ("router", "client") or name.startswith("worker")}
            assert len(parsers) == 2 + len(cl.groups) and "router" in parsers and "client" in parsers
            # Each component its own account: the router's, the replay client's (a process of
            # its own), and one per worker role.
            who = {"router": cl.accounts.of("router"), "client": cl.accounts.of("client")} | {
                name: cl.workers[hosts[0]].run_as for name, hosts in cl.groups.items()}
            for name, pid in parsers.items():
                ident = who[name]
                assert ident is not None
                assert_unprivileged(pid, Identity(ident.uid, ident.gid))
            roles = {cl.workers[hosts[0]].role: cl.workers[hosts[0]].run_as for hosts in cl.groups.values()}
            assert len({w.uid for w in [*roles.values(), who["router"], who["client"]] if w}) == len(roles) + 2, who
            begin(t0)

        return super().drive(dep, checked)


@pytest.mark.parametrize("policy", ["same-dc", "cross-dc"])
def test_policy_tokens_equal_reference(policy: str, prompts_and_refs) -> None:
    specs, refs = prompts_and_refs
    assert len(specs) >= 20 and min(len(s.prompt) for s in specs) == 16 and max(len(s.prompt) for s in specs) == 2048
    with Deployment(scenario_with(), parse_policy(policy), dtype="float64") as dep:
        run = dep.run(UnprivilegedCheck(specs))
    recs, router, stats = run.recs, run.router, run.workers
    assert compare(specs, refs, recs) == []
    df = request_rows(recs, router)
    # Prefix hits really skip compute: computed + reused = prompt tokens, and groups hit.
    assert (df.prefill_hit_tokens + df.prefill_computed == df.prompt_tokens).all()
    assert df.prefill_hit_tokens.sum() > 0
    pf = stats["prefill"].prefill
    assert pf is not None and pf.reused_tokens == df.prefill_hit_tokens.sum()
    # Only what the decoder lacks is sent: KV bytes track the tokens actually sent.
    assert (df.kv_tokens_sent <= df.prompt_tokens).all()
    decode_dc = "a" if policy == "same-dc" else "b"
    assert set(df.pipeline) == {f"P-D({decode_dc})"}
    assert (df.wan_kv_bytes > 0).any() == (policy == "cross-dc")
    # Every token timestamp is in order.
    for r in recs.values():
        assert list(r.token_times) == sorted(r.token_times)


def test_colocated_tokens_equal_reference(prompts_and_refs) -> None:
    # Two instances that prefill and decode (mixed steps), each its own account; the prompts
    # share prefixes in groups, which the router sends to the instance that holds them.
    specs, refs = prompts_and_refs
    hosts = {f"colo-{i}": {"role": "colocated"} for i in (1, 2)}
    with Deployment(scenario_with({"datacenters": {"a": {"hosts": hosts}}}), parse_policy("colocated"),
                    dtype="float64") as dep:
        run = dep.run(UnprivilegedCheck(specs))
    assert compare(specs, refs, run.recs) == []
    df = request_rows(run.recs, run.router)
    assert set(df.pipeline) == {"C(a)"} and (df.prefill_worker == df.decode_worker).all()
    assert (df.prefill_hit_tokens + df.prefill_computed == df.prompt_tokens).all()
    assert df.prefill_hit_tokens.sum() > 0 and df.kv_bytes.sum() == 0
    reused = sum(w.prefill.reused_tokens for w in run.workers.values() if w.role == "colocated" and w.prefill)
    assert reused == df.prefill_hit_tokens.sum()


def _specs(n: int, out: int) -> list[RequestSpec]:
    return [RequestSpec(f"k{i}", synth_tokens(f"kill-{i}", 64), out, at=0.02 * i) for i in range(n)]


def test_corrupted_kv_block_fails_request_cleanly() -> None:
    with Deployment(scenario_with(), parse_policy("cross-dc"),
                    worker_faults={"prefill": WorkerFaults(corrupt_block=1)}) as dep:
        recs = dep.run(TraceReplay(_specs(3, 4), timeout_s=60)).recs
    assert all(not r.ok for r in recs.values())
    assert all("checksum mismatch" in (r.error or "") for r in recs.values())


def test_dead_decode_worker_fails_its_requests_only() -> None:
    sc = scenario_with({"datacenters": {"b": {"hosts": {"decode-b": {"role": "decode"},
                                                         "decode-b2": {"role": "decode"}}}}})
    with Deployment(sc, parse_policy("cross-dc"), worker_faults={"decode-b": WorkerFaults(die_after_tokens=20)}) as dep:
        recs = dep.run(TraceReplay(_specs(8, 40), timeout_s=60)).recs
    failed = [r for r in recs.values() if not r.ok]
    done = [r for r in recs.values() if r.ok]
    assert failed and done, {r.rid: r.error for r in recs.values()}
    # Either the router saw decode-b's last will, or prefill's KV transfer to it broke first:
    # both reasons must name the dead worker (and never the healthy one).
    names_dead = re.compile(r"(worker decode-b died|KV transfer to decode-b:)")
    assert all(names_dead.search(r.error or "") for r in failed), [r.error for r in failed]
    assert all(r.workers == ["decode-b2"] and len(r.tokens) == 40 for r in done)
