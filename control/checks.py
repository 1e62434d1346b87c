"""What the router believes of a message before it acts on it: who sent it (its topic, not its
body), whether that worker is one of the request's, and whether it was already handled."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from protocol.messages import Event, Request
from protocol.refusals import refusal
from protocol.topics import Topics
from testbed.policies import Plan, WorkerView


def worker_of(topics: Topics, topic: str) -> str | None:
    """The worker a ``worker/<name>/...`` topic of this run belongs to."""
    head = f"{topics.root}/worker/"
    if not topic.startswith(head):
        return None
    name, sep, _ = topic[len(head):].partition("/")
    return name if sep and name else None


def speaks_for(topics: Topics, topic: str, claimed: str, rid: str | None) -> bool:
    """Who sent a status or an event is the topic's worker (only it may write there), not
    what the message says: a worker naming another is refused and logged, and touches
    nothing (it cannot declare another dead or end another's request)."""
    if claimed == worker_of(topics, topic):
        return True
    refusal(f"router: refused a message on {topic} claiming to be {claimed!r}{f' (for {rid})' if rid else ''}")
    return False


def in_plan(ev: Event, workers: Iterable[str | None]) -> bool:
    """Only the workers the router gave a request to speak for it: another worker's event
    for it (a failure, a transfer, a done) is refused and logged."""
    if ev.worker in workers:
        return True
    refusal(f"router: refused a {ev.kind} of {ev.rid} from {ev.worker}, not a worker of its plan")
    return False


def repeated(events: list[Event], ev: Event) -> bool:
    """QoS 1 delivers at least once: after a broker restart a worker's event can come twice.
    Acted on twice it would hand off twice, or count a transfer's WAN bytes twice. An event
    is its kind, worker and time (a worker stamps each one it sends), so a repeat is
    dropped and logged."""
    if not any(e.kind == ev.kind and e.worker == ev.worker and e.t == ev.t for e in events):
        return False
    print(f"router: dropped a repeated {ev.kind} of {ev.rid} from {ev.worker}", file=sys.stderr, flush=True)
    return True


def out_of_bounds(r: Request, vocab_size: int, max_context: int) -> str | None:
    """Why a request cannot be served as sent (None: it can): checked before any worker is
    told of it, so a prompt no worker could hold fails alone, with a reason, instead of
    raising in a prefill (a 1,048,577-token prompt once ended a prefill worker)."""
    if len(r.prompt) + r.max_new > max_context:
        return (f"{len(r.prompt)} prompt tokens and max_new {r.max_new} exceed the model's context of "
                f"{max_context} tokens")
    top = max(r.prompt)
    if top >= vocab_size:
        return f"token id {top} is outside the model's vocabulary (0..{vocab_size - 1})"
    return None


def unworkable(plan: Plan, workers: dict[str, WorkerView]) -> str | None:
    """Why the router cannot carry ``plan`` out (None: it can): a worker not of this
    deployment, or one told to prefill and decode a request that is not a colocated instance
    (a decoder would never answer the prefill command)."""
    unknown = sorted(plan.workers - set(workers))
    if unknown:
        return f"its plan names {', '.join(unknown)}, no worker of this deployment"
    if plan.colocated and workers[plan.decode].role != "colocated":
        w = workers[plan.decode]
        return f"its plan has {w.name} ({w.role}) prefill and decode a request: only a colocated worker can"
    return None
