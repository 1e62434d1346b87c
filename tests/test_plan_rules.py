"""A plan is data the router interprets by rules of its own (``control/rules.py``): each role's
loss, each event's meaning, for every policy alike; a plan naming a worker twice is refused
where it is built."""

from __future__ import annotations

import pytest

from control.checks import unworkable
from control.rules import after_death, after_event
from protocol.messages import Done, Failed, KvReceived
from testbed.policies import Plan, WorkerView

PDD = Plan("P-RLD-MD", "p", "md", relay="rld")
STRICT = Plan("P-RLD-MD", "p", "md", relay="rld", if_main_lost="fail")
PARKED = Plan("P-D+hold", "p", "d", hold=("far", "tier"))
COLOCATED = Plan("C(a)", "c", "c")  # one worker prefills and decodes


def _kv(worker: str) -> KvReceived:
    return KvReceived(rid="r", worker=worker, t=1.0, bytes=1, had=0, start=0.0, end=1.0)


def _failed(worker: str, target: str | None = None, before_handoff: bool = False) -> Failed:
    return Failed(rid="r", worker=worker, t=1.0, reason="x", target=target, before_handoff=before_handoff)


def _done(worker: str, handed_off: bool | None = None) -> Done:
    return Done(rid="r", worker=worker, t=1.0, output_tokens=1, handed_off=handed_off)


@pytest.mark.parametrize(("plan", "events", "dead", "handed_off", "outcome"), [
    (PDD, [], "md", False, "relay-alone"),           # PDD: the relay finishes alone
    (STRICT, [], "md", False, "fail"),               # the loss rule says otherwise
    (PDD, [], "md", True, "fail"),                   # after the handoff the main decoder is the stream
    (PDD, [], "rld", True, "unaffected"),            # a relay that handed over is not needed
    (PDD, [_kv("rld")], "p", False, "relay-alone"),  # the prefill still owed the main decoder its KV
    (PDD, [_kv("rld"), _kv("md")], "p", False, "unaffected"),
    (PARKED, [], "far", False, "unaffected"),        # a holder is never needed
    (PARKED, [_kv("d")], "p", False, "unaffected"),  # the streamer holds the KV; holders do not count
    (PARKED, [], "p", False, "fail"),
    (COLOCATED, [_kv("c")], "c", False, "fail"),   # it held the KV it received from itself: it is the request
])  # fmt: skip
def test_what_a_death_means_by_role(plan: Plan, events: list, dead: str, handed_off: bool, outcome: str) -> None:
    assert after_death(plan, events, dead, relay_up=True, handed_off=handed_off) == outcome


@pytest.mark.parametrize(("plan", "event", "handed_off", "step"), [
    (PARKED, _failed("far"), False, "holder-lost"),
    (PARKED, _failed("p", target="tier"), False, "holder-lost"),  # the prefill's transfer to a holder
    (PARKED, _kv("far"), False, "nothing"),
    (PARKED, _failed("p", target="d"), False, "fail"),
    (PARKED, _done("d"), False, "done"),
    (PDD, _failed("md", before_handoff=True), False, "relay-alone"),
    (STRICT, _failed("md", before_handoff=True), False, "fail"),
    (PDD, _failed("p", target="md"), True, "fail"),
    (PDD, _kv("md"), False, "handoff"),
    (PDD, _kv("rld"), False, "nothing"),
    (PDD, _done("rld", handed_off=True), False, "handed-over"),
    (PDD, _done("rld", handed_off=False), False, "relay-finished"),
    (PDD, _done("md"), True, "done"),
    (COLOCATED, _kv("c"), False, "nothing"),
    (COLOCATED, _done("c"), False, "done"),
])  # fmt: skip
def test_what_an_event_asks_of_the_router(plan: Plan, event: object, handed_off: bool, step: str) -> None:
    assert after_event(plan, event, handed_off) == step  # type: ignore[arg-type]


def test_a_worker_in_two_roles_is_refused_where_the_plan_is_built() -> None:
    with pytest.raises(ValueError, match="d named in two roles"):
        Plan("P-D", "p", "d", hold=("d",))
    with pytest.raises(ValueError, match="x named in two roles"):
        Plan("P-RLD-MD", "x", "md", relay="x")
    with pytest.raises(ValueError, match="c named in two roles"):  # colocated, and a holder too
        Plan("C", "c", "c", hold=("c",))
    assert COLOCATED.colocated and not PDD.colocated and COLOCATED.workers == {"c"}
    assert COLOCATED.receivers == ("c",)
    assert PARKED.receivers == ("d", "far", "tier") and PDD.streamers == ("rld", "md")
    assert PDD.role_of("rld") == "lead" and PARKED.role_of("tier") == "hold" and PARKED.role_of("z") is None


def test_the_router_refuses_a_plan_it_cannot_carry_out() -> None:
    views = {n: WorkerView(n, role, "a", "10.0.0.1", 7000) for n, role in
             (("p", "prefill"), ("d", "decode"), ("c", "colocated"))}
    assert unworkable(Plan("P-D", "p", "d"), views) is None and unworkable(COLOCATED, views) is None
    assert "names x, no worker" in (unworkable(Plan("P-D", "p", "x"), views) or "")
    # A decoder told to prefill its own request would never answer the prefill command.
    assert "d (decode) prefill and decode" in (unworkable(Plan("C", "d", "d"), views) or "")
