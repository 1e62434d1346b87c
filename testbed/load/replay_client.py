"""The measuring client: sends requests, receives streamed tokens, timestamps each token.

Transport and measurement are separate (as in vLLM's serving benchmark): this module only
sends requests at their arrival times and records what came back and when
(``ClientRecord``); ``testbed.analysis.metrics`` turns records into TTFT/TPOT/ITL/E2E.

It runs on a thread of the orchestrator that has entered the client host's namespace, so
its broker connection is a real connection from the client host across the emulated
network.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiomqtt
from pydantic import ValidationError

from protocol import clock
from protocol.messages import Request, RouterStatus, why_invalid
from protocol.mqtt_session import Session
from protocol.refusals import refusal
from protocol.stream_gate import StreamGate
from protocol.token_stream import TokenStreamError
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo
from testbed.deploy.run_record import ClientRecord
from testbed.load.retry import NO_RETRY, RetryPolicy, attempt_rid, retryable
from testbed.traces.workload import RequestSpec
from workers.transport import Transport


class ProtocolError(Exception):
    pass


async def connect_when_ready(session: Session, on_message: Callable[[aiomqtt.Message], Awaitable[None]],
                             ready: asyncio.Event, stop: asyncio.Event, wait_s: float = 120.0) -> asyncio.Task[None]:
    """Run ``session`` (until ``stop``) and wait until ``on_message`` has set ``ready`` (the
    router said its workers are up). Returns the connection's task; raises the broker's
    error, or ``ProtocolError`` when the router is not ready within ``wait_s``."""

    async def no_op(first: bool) -> None:
        return None

    connection = asyncio.create_task(session.run(on_message, no_op, stop))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({connection, waiting}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    if not ready.is_set():
        stop.set()
        waiting.cancel()
        if connection.done():
            connection.result()  # the broker could not be reached: its error
        connection.cancel()
        raise ProtocolError(f"the router did not report ready within {wait_s:g} s (workers failed to start?)")
    return connection


# A broker that restarts sends the router's will, then the router reconnects and says
# "ready" again (1-3 s here): only a router silent this long (emulated seconds) after "down" is gone.
ROUTER_GRACE_S = 10.0


@dataclass(frozen=True)
class ClientOptions:
    timeout_s: float  # real seconds: the whole replay's bound
    router_grace_s: float = ROUTER_GRACE_S  # real seconds after the router's "down"
    retry: RetryPolicy = NO_RETRY
    backoff_scale: float = 1.0  # real seconds per second of the retry policy's backoff (the dilation)


async def replay(transport: Transport, broker: BrokerInfo, topics: Topics, specs: list[RequestSpec],
                 opts: ClientOptions, progress: Callable[[int, int, int], None] | None,
                 on_start: Callable[[float], None] | None = None,
                 on_end: Callable[[ClientRecord], None] | None = None) -> dict[str, ClientRecord]:
    """Send ``specs`` at their times (and sessions' turns after their previous one) through
    ``transport``'s broker; every request's record once each has ended or the timeout passed
    (``on_end`` is handed each as it ends, before the timeout)."""
    recs = {s.rid: ClientRecord(s.rid, len(s.prompt), s.max_new) for s in specs}
    live = dict(recs)  # by the id of each request's current attempt
    by_rid = {s.rid: s for s in specs}
    followers: dict[str, list[RequestSpec]] = {}
    waits: dict[str, set[str]] = {}  # a closed-loop request's predecessors still to complete
    for s in specs:
        for before in ([s.after, *s.also_after] if s.after is not None else []):
            if before not in by_rid:
                raise ProtocolError(f"request {s.rid} follows unknown request {before}")
            followers.setdefault(before, []).append(s)
            waits.setdefault(s.rid, set()).add(before)
    finished = asyncio.Event()
    n_done = 0
    pending: set[asyncio.Task[None]] = set()
    client = transport.mqtt_client(broker, f"{topics.root}-client-{secrets.token_hex(4)}", 10)
    session = Session(client, [topics.all_streams, topics.all_tokens, topics.router_status], "client")
    gate = StreamGate(topics, "client")
    ready = asyncio.Event()

    router_gone: asyncio.TimerHandle | None = None

    def router_lost(state: str) -> None:
        """The router said "down" (its last will) or "stopped" and did not come back: every
        request still open fails now, with that reason, instead of at the client's timeout."""
        gone = f"router {state}" if session.connected.is_set() else "broker unreachable"  # its stop sent the will
        for r in recs.values():
            if not r.done:
                r.error, r.done = f"{gone}: not answered", True
                complete(r)

    async def on_message(msg: aiomqtt.Message) -> None:
        nonlocal router_gone
        now = clock.now()
        payload = msg.payload if isinstance(msg.payload, (bytes, bytearray)) else b""
        topic = str(msg.topic)
        try:
            if topic == topics.router_status:
                state = RouterStatus.model_validate_json(payload).state
                if state == "ready":
                    ready.set()
                    if router_gone is not None:  # back (a broker restart sent its will)
                        router_gone.cancel()
                        router_gone = None
                        print("client: the router is ready again", file=sys.stderr, flush=True)
                elif ready.is_set() and router_gone is None:
                    router_gone = asyncio.get_running_loop().call_later(opts.router_grace_s, router_lost, state)
                    print(f"client: the router says {state}; open requests fail in {opts.router_grace_s:g} s "
                          "unless it says ready again", file=sys.stderr, flush=True)
                return
            chunks = gate.read(topic, payload)
        except (ValidationError, TokenStreamError) as e:
            # A malformed message ends the requests it names (those of ours), never the
            # reader: the other requests go on.
            why = why_invalid(e) if isinstance(e, ValidationError) else str(e)
            refusal(f"client: rejected a message on {topic}: {why}")
            for rid in e.rids if isinstance(e, TokenStreamError) else []:
                bad = live.get(rid)
                if bad is not None and not bad.done:
                    bad.error, bad.done = f"client rejected a token message: {why}", True
                    ended(bad)
            return
        for t in chunks:
            rec = live.get(t.rid)
            if rec is None or rec.done:
                continue
            rec.accept(t, now)
            if rec.done:
                ended(rec)

    def ended(rec: ClientRecord) -> None:
        """An attempt ended: the request is complete, or failed and is sent again after the
        retry policy's backoff (under a new id) while it has retries left."""
        tries = len(rec.retried)
        if rec.error is None or tries >= opts.retry.retries or not retryable(rec.error):
            complete(rec)
            return
        nxt = attempt_rid(rec.rid, tries + 1)
        del live[rec.last_rid]  # what still comes for the failed attempt is dropped
        gate.forget(rec.last_rid)
        rec.retry(nxt, clock.now())
        live[nxt] = rec
        later(send(by_rid[rec.rid], opts.retry.backoff_s(rec.rid, tries) * opts.backoff_scale))

    def later(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        pending.add(task)
        task.add_done_callback(pending.discard)

    def complete(rec: ClientRecord) -> None:
        nonlocal n_done
        n_done += 1
        rec.ended = clock.now()
        gate.forget(rec.last_rid)
        if on_end is not None:
            on_end(rec)
        if n_done == len(recs):
            finished.set()
        for nxt in followers.get(rec.rid, []):
            if recs[nxt.rid].done:  # failed already, by another of the calls it waited on
                continue
            if rec.ok:  # its delay after its last answer, and not before its own time (a tree's child)
                waits[nxt.rid].discard(rec.rid)
                if not waits[nxt.rid]:
                    later(send(nxt, max(nxt.delay, t0 + nxt.at - clock.now())))
            else:
                # An agent cannot take its next turn without this turn's answer (its retries spent).
                f = recs[nxt.rid]
                f.error, f.done = f"not sent: previous turn {rec.rid} failed", True
                complete(f)

    async def send(spec: RequestSpec, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        rec = recs[spec.rid]
        if rec.done:  # failed meanwhile (the router or the broker gone): nothing to send
            return
        rec.attempt_sent = clock.now()
        rec.sent = rec.sent or rec.attempt_sent
        try:
            req = Request(rid=rec.last_rid, prompt=list(spec.prompt), max_new=spec.max_new, hints=spec.sent_hints())
        except ValidationError as e:  # no router could take it: it fails here, alone
            rec.error, rec.done = f"not sent: {why_invalid(e)}", True
            complete(rec)
            return
        gate.expect(rec.last_rid, spec.max_new)
        await session.publish(topics.requests, req.dump())

    stop = asyncio.Event()
    connection = await connect_when_ready(session, on_message, ready, stop)
    t0 = clock.now()
    if on_start is not None:
        on_start(clock.monotonic())

    lost_since: float | None = None  # the broker unreachable since (client's monotonic clock)

    async def ticker() -> None:
        nonlocal lost_since
        while True:
            await asyncio.sleep(1.0)
            # A broker gone for good (not a restart's few seconds): nothing will answer, so what
            # is still open fails now with that reason instead of at the replay's timeout.
            if session.connected.is_set():
                lost_since = None
            else:
                lost_since = clock.monotonic() if lost_since is None else lost_since
                if clock.monotonic() - lost_since > opts.router_grace_s:
                    for r in recs.values():
                        if not r.done:
                            r.error, r.done = (f"broker unreachable for {opts.router_grace_s:g} s: "
                                               f"{'not answered' if r.sent else 'not sent'}"), True
                            complete(r)
            if progress:
                failed = sum(1 for r in recs.values() if r.done and r.error)
                progress(n_done, len(recs), failed)

    tick = asyncio.create_task(ticker())
    for spec in sorted((s for s in specs if s.after is None), key=lambda s: s.at):
        await send(spec, t0 + spec.at - clock.now())
    try:
        await asyncio.wait_for(finished.wait(), timeout=opts.timeout_s)
    except TimeoutError:
        for r in recs.values():
            if not r.done:
                what = "no completion" if r.sent else "not sent (waiting for its previous turn)"
                r.error, r.done, r.ended = f"{what} within the client timeout ({opts.timeout_s} s)", True, clock.now()
    tick.cancel()
    for task in list(pending):
        task.cancel()
    stop.set()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(connection, 5)
    return recs
