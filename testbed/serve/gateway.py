"""The front end's control-plane side: a request in, its token stream out, over the same
MQTT contracts as the replayer (``Request`` to the router, token batches back).

It runs on the serving thread, inside the client host's namespace, so every request enters
the emulated network where the replayer's would. Each request is recorded as a
``ClientRecord`` (sent = when the front end published it; token times = when its tokens
reached the front end) and a ``RequestSpec``, so a served run is saved and measured with
the same code as a replayed one (``testbed.analysis.metrics.request_rows``). Only requests in
flight stay in memory: ``finish`` writes an ended one to ``records`` and lets it go.

Guarantees: a stream yields its tokens once each, in order (``ClientRecord.accept``); it
ends with the request's completion, its failure (``RequestFailed``, with the reason the
router or a worker gave) or, when neither comes within ``timeout_s``, a timeout failure.
A stream closed before its end (the HTTP client went away) cancels the request in the
emulation: the router ends it on every worker it runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO

import aiomqtt
from pydantic import ValidationError

from protocol import clock
from protocol.messages import CancelRequest, Request, RequestHints, RouterStatus, why_invalid
from protocol.mqtt_session import Session
from protocol.refusals import refusal
from protocol.stream_gate import StreamGate
from protocol.token_stream import TokenStreamError
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo
from testbed.deploy.run_record import ClientRecord
from testbed.load.replay_client import connect_when_ready
from testbed.serve.record import write_served
from testbed.traces.workload import RequestSpec


class RequestFailed(Exception):
    pass


class NotReady(Exception):
    pass


@dataclass
class _Pending:
    rec: ClientRecord
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Gateway:
    def __init__(self, broker: BrokerInfo, topics: Topics, timeout_s: float, records: IO[str]) -> None:
        self.topics, self.timeout_s = topics, timeout_s
        self.records: dict[str, ClientRecord] = {}  # in flight, or ended and not yet written
        self.specs: dict[str, RequestSpec] = {}
        self._out = records  # one line per ended request (``testbed.serve.record``)
        self.t0 = clock.now()
        self._pending: dict[str, _Pending] = {}
        self._ready = asyncio.Event()
        self.router_state = "starting"  # or the router's last word: ready, stopped, down
        self._stop = asyncio.Event()
        client = Session.client_for(broker.host, broker.port, broker.username, broker.password,
                                    f"{topics.root}-serve-{secrets.token_hex(4)}", keepalive=10)
        self._session = Session(client, [topics.all_streams, topics.all_tokens, topics.router_status], "serve")
        self._gate = StreamGate(topics, "serve")
        self._task: asyncio.Task[None] | None = None
        self._cancels: set[asyncio.Task[None]] = set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def broker_up(self) -> bool:
        """Connected to the broker now (a stopped broker leaves the router's last "ready")."""
        return self._session.connected.is_set()

    async def start(self, wait_s: float = 120.0) -> None:
        """Connect and wait until the router says it is ready (its workers are up)."""
        self._task = await connect_when_ready(self._session, self._on_message, self._ready, self._stop, wait_s)
        self.t0 = clock.now()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)
        for p in self._pending.values():  # a request still running when the server stops
            if not p.rec.done:
                p.rec.error, p.rec.done, p.rec.ended = "server stopped before it finished", True, clock.now()
                p.changed.set()
        for rid in list(self.records):
            self.finish(rid)
        self._out.close()

    def finish(self, rid: str) -> ClientRecord | None:
        """An ended request: written to the records file and forgotten; its record (None if
        it was already written)."""
        rec, spec = self.records.pop(rid, None), self.specs.pop(rid, None)
        if rec is None or spec is None:
            return None
        if not self._out.closed:
            write_served(self._out, spec, rec)
        return rec

    async def _on_message(self, msg: aiomqtt.Message) -> None:
        now = clock.now()
        payload = msg.payload if isinstance(msg.payload, (bytes, bytearray)) else b""
        topic = str(msg.topic)
        try:
            if topic == self.topics.router_status:
                # /health and new requests follow the router: "down" is its last will.
                self.router_state = RouterStatus.model_validate_json(payload).state
                if self.router_state == "ready":
                    self._ready.set()
                else:
                    self._ready.clear()
                return
            chunks = self._gate.read(topic, payload)
        except (ValidationError, TokenStreamError) as e:
            why = why_invalid(e) if isinstance(e, ValidationError) else str(e)
            refusal(f"serve: rejected a message on {topic}: {why}")
            for rid in e.rids if isinstance(e, TokenStreamError) else []:
                p = self._pending.get(rid)
                if p is not None and not p.rec.done:
                    p.rec.error, p.rec.done, p.rec.ended = f"rejected a token message: {why}", True, now
                    p.changed.set()
            return
        for t in chunks:
            p = self._pending.get(t.rid)
            if p is None:
                continue
            if p.rec.accept(t, now) or p.rec.done:
                if p.rec.done:
                    p.rec.ended = now
                p.changed.set()

    async def generate(self, prompt: list[int], max_new: int, ignore_eos: bool, rid: str) -> AsyncIterator[list[int]]:
        """Send one request; yield its new tokens as they arrive (at least one per yield)."""
        if not self.ready:
            raise NotReady("the emulation is still starting")
        rec = ClientRecord(rid, len(prompt), max_new)
        p = self._pending[rid] = _Pending(rec)
        self.records[rid] = rec
        self._gate.expect(rid, max_new)
        rec.sent = clock.now()
        self.specs[rid] = RequestSpec(rid=rid, prompt=[], max_new=max_new, at=rec.sent - self.t0,
                                      hints=RequestHints(tag="http"))
        try:
            # Not awaited for the broker's acknowledgement in the request's own time: the
            # replayer's publish does not wait either once connected.
            await self._session.publish(self.topics.requests,
                                        Request(rid=rid, prompt=prompt, max_new=max_new, ignore_eos=ignore_eos).dump())
            seen, deadline = 0, rec.sent + self.timeout_s
            while True:
                if len(rec.tokens) > seen:
                    new, seen = rec.tokens[seen:].tolist(), len(rec.tokens)
                    yield new
                    continue
                if rec.done:
                    if rec.error is not None:
                        raise RequestFailed(rec.error)
                    return
                p.changed.clear()
                try:
                    await asyncio.wait_for(p.changed.wait(), max(0.0, deadline - clock.now()))
                except TimeoutError:
                    rec.error, rec.done, rec.ended = (f"no completion within the server's timeout "
                                                      f"({self.timeout_s:g} s)"), True, clock.now()
                    self._cancel(rid, rec.error)
        finally:
            self._pending.pop(rid, None)
            self._gate.forget(rid)
            if not rec.done:  # the HTTP client went away: the emulation stops working on it
                rec.error, rec.done, rec.ended = "the HTTP client disconnected", True, clock.now()
                self._cancel(rid, rec.error)

    def _cancel(self, rid: str, reason: str) -> None:
        """Tell the router to end ``rid`` everywhere (a task of its own: this may run while the
        request's handler is being cancelled)."""
        task = asyncio.create_task(self._session.publish(self.topics.cancels,
                                                         CancelRequest(rid=rid, reason=reason).dump()))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
