"""What the death of one of a request's workers means for it, by the plan's roles: a rule
of its own (data in, a verdict out), so that the router only carries it out."""

from __future__ import annotations

from typing import Literal

from protocol.messages import Event, KvReceived
from testbed.policies import Plan

Outcome = Literal["unaffected", "relay-alone", "fail"]


def after_death(plan: Plan, events: list[Event], dead: str, relay_up: bool, handed_off: bool) -> Outcome:
    """Nothing when the request no longer needs the dead worker (a prefill whose KV every
    decoder holds, a relay that handed over); the relay finishes alone when the main decoder
    (or the prefill that still owed it KV) is lost before the handoff; otherwise the request
    fails, saying which worker died."""
    received = {e.worker for e in events if isinstance(e, KvReceived)}
    relay = plan.relay
    relay_can_finish = relay is not None and relay != dead and relay_up and not handed_off
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
