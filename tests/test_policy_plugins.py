"""A user's policy in one file, outside the repository: it loads by its path, runs in the
simulator (and, as root, in the emulation) with no file of the testbed changed, passes
``policy check``, appears in the results and in ``tune``'s search; a bad plugin is an exit-2
error naming its file and line; a plugin whose decision raises fails that request, never the
router; root imports no plugin another account could have written."""

from __future__ import annotations

import json
import os
import pwd
import textwrap
from pathlib import Path

import pytest

from testbed.experiments.tune import defaults, search_space
from testbed.load.trace_replay import TraceReplay
from testbed.policies import PolicyError, make_policy, parse_policy, policy_class
from testbed.scenario import load_scenario
from testbed.sim.engine import SimDeployment, sim_plan
from testbed.traces import load_trace

from .conftest import ROOT, TOPOLOGIES, needs_root, run_cli_output, scenario_with

NEAR_FIRST = '''
from pydantic import BaseModel, ConfigDict, Field

from testbed.policies import ClusterView, Plan, Policy, RequestState, register


class NearFirstOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    far_every: int = Field(default=3, ge=1, le=10, description="every n-th request decodes across the line")


@register
class NearFirst(Policy):
    """Decode next to prefill, but every far_every-th request across the line."""

    name = "near-first"
    Options = NearFirstOptions
    deploys = (("prefill", "home"), ("decode", "home"), ("decode", "away"))
    crosses_wan = True

    def __init__(self, options=None):
        super().__init__(options)
        self.n = 0

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        self.n += 1
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        if self.n % self.opts.far_every == 0:
            d = cluster.pick_outside("decode", p.dc, prompt=req.prompt)
        else:
            d = cluster.pick("decode", dc=p.dc, prompt=req.prompt)
        return Plan(f"P-D({d.dc})", p.name, d.name)
'''


def _plugin(folder: Path, text: str, name: str = "near_first.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_policy_in_a_file_of_its_own_runs_checks_and_tunes(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    plugin = _plugin(tmp_path, NEAR_FIRST)
    spelling = f"{plugin}:NearFirst:far_every=2"
    spec = parse_policy(spelling)
    assert (spec.name, spec.source, spec.options) == ("near-first", f"{plugin}:NearFirst", {"far_every": 2})
    out = tmp_path / "run"
    code, stdout, err = run_cli_output(["run", "--engine", "sim", "--scenario", str(TOPOLOGIES / "two-dc.yaml"),
                                        "--trace", "traces/agentic-quick.jsonl", "--token-scale", "16", "--limit",
                                        "20", "--policies", f"same-dc,{spelling}", "--out", str(out)], capsys)
    assert code == 0, err[-2000:]
    s = json.loads((out / "summary.json").read_text())["policies"]
    assert set(s) == {"same-dc", "near-first:far_every=2"}
    mine = s["near-first:far_every=2"]
    assert mine["completed"] == 20 and set(mine["pipelines"]) == {"P-D(a)", "P-D(b)"} and mine["wan_kv_bytes"] > 0
    assert mine["policy_stats"]["options"] == "near-first:far_every=2"
    # policy check: every check passes (the emulation's token check needs root: not here).
    code, stdout, err = run_cli_output(["policy", "check", spelling, "--scenario", str(TOPOLOGIES / "two-dc.yaml"),
                                        "--no-verify", "--limit", "24"], capsys)
    assert code == 0 and "\npassed" in stdout and stdout.count("  pass  ") == 5, stdout + err
    # tune: its knob is the search space, from its Options.
    cls = policy_class(spec)
    assert list(search_space(cls)) == ["far_every"] and defaults(cls, search_space(cls)) == {"far_every": 3}
    assert search_space(cls, fixed=spec.options) == {}  # a given option stays as given


@pytest.mark.parametrize(("text", "says"), [
    ("def broken(:\n", "near_first.py:1: importing the policy failed: SyntaxError"),
    ("x = 1\nraise RuntimeError('no luck')\n", "near_first.py:2: importing the policy failed: RuntimeError: no luck"),
    ("class NearFirst:\n    pass\n", "no Policy subclass 'NearFirst'"),
    (NEAR_FIRST.replace('name = "near-first"', 'name = "pdd"'), "the name 'pdd' is taken by"),
    (NEAR_FIRST.replace('name = "near-first"', 'name = "Near First!"'), "NearFirst.name must be a name of its own"),
    (NEAR_FIRST.replace("default=3, ge=1", "ge=1"), "every option needs a default"),
])  # fmt: skip
def test_a_bad_plugin_is_an_error_naming_its_file_and_line(tmp_path: Path, text: str, says: str) -> None:
    plugin = _plugin(tmp_path, text)
    with pytest.raises(PolicyError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_policy(f"{plugin}:NearFirst")
    with pytest.raises(PolicyError, match="no such file"):
        parse_policy(f"{tmp_path}/absent.py:NearFirst")
    with pytest.raises(PolicyError, match=r"near-first: option far_every='0'"):
        parse_policy(f"{_plugin(tmp_path, NEAR_FIRST, 'ok.py')}:NearFirst:far_every=0")


def test_a_decision_that_raises_fails_its_request_and_the_router_goes_on(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path, NEAR_FIRST.replace(
        "        self.n += 1\n", "        self.n += 1\n        if self.n % 4 == 0:\n            1 / 0\n"))
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(12)
    with SimDeployment(sc, parse_policy(f"{plugin}:NearFirst"), emulation=sim_plan(sc, 16)) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    failed = {rid: r.error or "" for rid, r in run.recs.items() if r.error}
    raised = [why for why in failed.values() if "plan raised ZeroDivisionError" in why]
    assert raised and all(f"(at {plugin}:" in why for why in raised)
    assert all(why.startswith("policy near-first: plan raised") for why in raised)
    assert sum(r.ok for r in run.recs.values()) >= 6  # the others went on
    assert run.component_errors == [] and run.deaths == []


@needs_root
def test_root_imports_no_plugin_another_account_could_have_written(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    plugin = _plugin(theirs, NEAR_FIRST, "theirs.py")
    os.chown(plugin, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(PolicyError, match="refused as root: .*theirs.py is owned by uid"):
        parse_policy(f"{plugin}:NearFirst")
    os.chown(plugin, 0, 0)
    theirs.chmod(0o777)
    with pytest.raises(PolicyError, match="refused as root: .*theirs is owned by uid 0 or writable by other"):
        parse_policy(f"{plugin}:NearFirst")


@needs_root
@pytest.mark.slow
def test_a_plugin_runs_in_the_emulation_unchanged(tmp_path: Path) -> None:
    """The router process imports the plugin's file (root's) and runs it after dropping root."""
    from testbed.deploy.deployment import Deployment
    from testbed.load.verify import compare, verification_prompts
    from workers.model import ModelRunner, ensure_default_model

    plugin = _plugin(tmp_path, NEAR_FIRST)
    spec = parse_policy(f"{plugin}:NearFirst:far_every=2")
    specs = verification_prompts(6, seed=3, max_len=256)
    runner = ModelRunner(ensure_default_model(), "float64")
    refs = {s.rid: runner.reference(list(s.prompt), s.max_new) for s in specs}
    with Deployment(scenario_with(), spec, dtype="float64") as dep:
        run = dep.run(TraceReplay(specs, timeout_s=120))
    assert compare(specs, refs, run.recs) == []
    assert {r.pipeline for r in run.router.values()} == {"P-D(a)", "P-D(b)"}
    assert run.policy.options == make_policy(spec).describe()


PARKED = '''
from testbed.policies import ClusterView, Plan, Policy, RequestState


class Parked(Policy):
    """Decode next to prefill; park every prompt's KV in a decoder across the line too."""

    name = "parked"
    deploys = (("prefill", "home"), ("decode", "home"), ("decode", "away"))
    crosses_wan = True

    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        p = cluster.pick("prefill", dc=self.ctx.home_dc, prompt=req.prompt)
        d = cluster.pick("decode", dc=p.dc, prompt=req.prompt)
        try:
            hold = (cluster.pick_outside("decode", p.dc).name,)
        except LookupError:  # none alive across the line: served all the same
            hold = ()
        return Plan("P-D+hold" if hold else "P-D", p.name, d.name, hold=hold, if_main_lost="fail")
'''


def test_a_plan_parks_kv_in_a_holder_across_the_line(tmp_path: Path) -> None:
    """The plan's ``hold`` role: the far decoder takes every prompt's KV into its cache and
    streams nothing; that KV is the run's WAN KV; a holder's death fails no request."""
    from protocol.messages import Done, KvReceived
    from testbed.analysis.metrics import request_rows
    from testbed.faults.timeline import parse_fault

    plugin = _plugin(tmp_path, PARKED, "parked.py")
    sc = load_scenario(TOPOLOGIES / "two-dc.yaml")
    wl = load_trace(ROOT / "traces/agentic-quick.jsonl", "auto", 16).select(16)
    with SimDeployment(sc, parse_policy(f"{plugin}:Parked"), emulation=sim_plan(sc, 16),
                       timeline=[parse_fault("kill@8:host=decode-b")]) as dep:
        run = dep.run(TraceReplay(wl.specs(1.0), 600, show_progress=False))
    assert all(r.ok for r in run.recs.values()), [r.error for r in run.recs.values() if not r.ok]
    recs = run.router.values()
    assert {tuple(r.hold) for r in recs} == {("decode-b",), ()} and {r.pipeline for r in recs} == {"P-D+hold", "P-D"}
    parked = [r for r in recs if any(isinstance(e, KvReceived) and e.worker == "decode-b" for e in r.events)]
    assert parked and all(e.cache_only for r in parked for e in r.events
                          if isinstance(e, KvReceived) and e.worker == "decode-b")
    assert not any(isinstance(e, Done) and e.worker == "decode-b" for r in recs for e in r.events)
    assert len(parked) < len(recs)  # some came after decode-b died, and completed all the same
    wan = request_rows(run.recs, run.router).set_index("rid").wan_kv_bytes
    assert all(wan[r.rid] > 0 for r in parked) and wan.sum() > 0
