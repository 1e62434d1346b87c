"""What an event or a death means for a request, by its plan's roles and loss rule
(``testbed/policies/plan.py``): rules of their own (data in, a verdict out), the same for
every policy, so that the router only carries them out."""

from __future__ import annotations

from typing import Literal

from protocol.messages import Done, Event, Failed, KvReceived
from testbed.policies import Plan

Outcome = Literal["unaffected", "relay-alone", "fail"]
Step = Literal["nothing", "holder-lost", "relay-alone", "fail", "handoff", "handed-over", "relay-finished", "done"]


def after_death(plan: Plan, events: list[Event], dead: str, relay_up: bool, handed_off: bool) -> Outcome:
    """Nothing when the request no longer needs the dead worker (a prefill whose KV every
    streamer holds, a lead that handed over, any holder); the lead finishes alone when the
    main decoder (or the prefill that still owed it KV) is lost before the handoff and the
    plan says ``if_main_lost="lead-alone"``; otherwise the request fails, saying which worker
    died."""
    if dead in plan.hold:
        return "unaffected"
    if plan.colocated and dead == plan.decode:  # it held everything the request had
        return "fail"
    received = {e.worker for e in events if isinstance(e, KvReceived)}
    relay = plan.relay
    relay_can_finish = (relay is not None and relay != dead and relay_up and not handed_off
                        and plan.if_main_lost == "lead-alone")
    if dead == plan.prefill:
        if plan.decode in received and (relay is None or relay in received):
            return "unaffected"
        if relay_can_finish and relay in received:
            return "relay-alone"
    elif dead == relay:
        if handed_off:
            return "unaffected"
    elif dead == plan.decode and relay_can_finish:
        return "relay-alone"
    return "fail"


def after_event(plan: Plan | None, ev: Event, handed_off: bool) -> Step:
    """What a worker's event asks of the router: a holder's failure (or its transfer's) is
    logged and nothing more; a failure before the handoff that loses the main decoder leaves
    the lead alone (by the loss rule), any other fails the request; the main decoder holding
    the KV behind a lead is the handoff's moment; the lead's ``Done`` is a handover or, if it
    finished first, the request's end (the policy's ``cut_off`` then); a streamer's ``Done``
    ends the request."""
    if plan is not None and (ev.worker in plan.hold or (isinstance(ev, Failed) and ev.target in plan.hold)):
        return "holder-lost" if isinstance(ev, Failed) else "nothing"
    relay = plan.relay if plan else None
    if isinstance(ev, Failed):
        if (plan is not None and relay is not None and not handed_off and plan.if_main_lost == "lead-alone"
                and (ev.before_handoff or ev.target == plan.decode)):
            return "relay-alone"
        return "fail"
    if isinstance(ev, KvReceived) and plan is not None and relay and ev.worker == plan.decode:
        return "handoff"
    if isinstance(ev, Done) and relay and ev.worker == relay:
        return "handed-over" if ev.handed_off else "relay-finished"
    return "done" if isinstance(ev, Done) else "nothing"
