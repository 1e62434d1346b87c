"""Router process (datacenter a): admits requests, asks the policy for a plan, dispatches,
tracks every request in flight until it completes or fails with a reason.

Run as ``python -m control CONFIG.json`` (``control/__main__.py``) inside the router host's namespace. It
learns worker liveness and load from their retained status messages (a worker that dies
is announced by its MQTT last will, which ``control.liveness`` confirms or, with
``failure_detection: none``, ignores) and ends every request that depended on a dead worker,
or that exceeds the request timeout, with an explicit error to the client. A message that
fails validation is logged and fails only the request it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import aiomqtt
from pydantic import ValidationError

from control.checks import in_plan, out_of_bounds, repeated, speaks_for, unworkable
from control.decisions import Decisions, PolicyFailed
from control.ended import Ended
from control.held import Held
from control.liveness import Liveness
from control.rules import after_death, after_event
from protocol import clock
from protocol.messages import (
    CancelCmd,
    CancelRequest,
    DecodeCmd,
    Event,
    Failed,
    HandoffCmd,
    KVTarget,
    PrefillCmd,
    Request,
    RouterStatus,
    Status,
    Tokens,
    WarmCmd,
    parse_event,
    rid_of,
    why_invalid,
)
from protocol.mqtt_session import Session
from protocol.refusals import refusal
from protocol.router_config import RequestRecord, RouterConfig
from protocol.topics import Topics
from protocol.worker_config import PREFILL_ROLES
from testbed.policies import ClusterView, Policy, RequestState
from testbed.policies.base import WorkerView
from workers.allocator import WATCH
from workers.privilege import OutDir
from workers.transport import HOST, Transport

MEMORY_REPORT_S = 30  # seconds between writes of the router's memory report
T = TypeVar("T")


class Router:
    def __init__(self, cfg: RouterConfig, transport: Transport = HOST) -> None:
        self.cfg = cfg
        self.transport = transport  # the broker and the workers' ports: the host's network or a simulator's
        self.topics = Topics(cfg.run_id)
        self.decisions = Decisions(cfg.policy, cfg.context)  # the policy, built once the router dropped root
        self.view = ClusterView({n: WorkerView(n, w.role, w.dc, w.host, w.kv_port, tflops=w.prefill_tflops)
                                 for n, w in cfg.workers.items()},
                                block_size=cfg.context.block_size,
                                cache_tokens=cfg.context.decode_cache_tokens or 262144,
                                exact_roles=frozenset(PREFILL_ROLES if cfg.context.prefill_exact_states else ()))
        self.inflight: dict[str, RequestState] = {}
        self.ended = Ended(cfg.dilation)  # finished: kept for their late events, then on disk
        self.session: Session | None = None
        self.ready = False
        # Opened while privileged: the router writes only here once it has dropped root.
        self.out = OutDir(Path(cfg.records_path).parent)
        self.liveness = Liveness(cfg, self.view.workers, self._worker_died, self.out, transport.probe)
        WATCH.add_holder(Held(lambda: sum(q.nbytes for q in self.inflight.values()) + self.ended.nbytes
                              + sum(i.nbytes for i in self.view.held.values()) + self.policy.nbytes))
        self.repeated_requests = 0
        self.repeated_events = 0

    @property
    def policy(self) -> Policy:
        return self.decisions.policy

    def _decided(self, what: str, decide: Callable[[], T]) -> T:
        return self.decisions.decided(what, decide)

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        assert self.session is not None
        await self.session.publish(topic, payload, retain=retain)

    async def main(self, stop: asyncio.Event | None = None) -> None:
        """Route until ``stop`` is set (None: until SIGTERM or SIGINT)."""
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        b = self.cfg.broker
        # The last will: a router that dies (or loses the broker) says so, retained, instead of
        # leaving its "ready" for clients to wait on until their timeout.
        down = RouterStatus(state="down", workers={}, policy=self.policy.describe()).dump()
        will = aiomqtt.Will(self.topics.router_status, down, qos=1, retain=True)
        client = self.transport.mqtt_client(b, f"{self.cfg.run_id}-router", 5, will)
        self.session = Session(client, [self.topics.requests, self.topics.cancels, self.topics.all_status,
                                        self.topics.all_events], "router")
        self.session.on_error = self._reject
        self.liveness.session = self.session

        async def on_connect(first: bool) -> None:
            if self.ready:  # retained: a restarted broker may have lost it
                await self._publish_state("ready")

        async def on_stop() -> None:
            for rid in list(self.inflight):
                await self._fail(rid, "router stopped")
            await self._publish_state("stopped")

        settled = asyncio.Event()

        async def settle() -> None:
            await stop.wait()
            await self.ended.settle(self.view.workers)
            settled.set()

        name = Path(self.cfg.records_path).name
        with os.fdopen(self.out.open(name), "w") as self.ended.file, contextlib.ExitStack() as traced:
            if self.cfg.trace_decisions:
                self.decisions.traced = traced.enter_context(os.fdopen(self.out.open(name + ".decisions.jsonl"), "w"))
            sweeper = asyncio.create_task(self._sweep())
            settler = asyncio.create_task(settle())
            await self.session.run(self._on_message, on_connect, settled, on_stop)
            sweeper.cancel()
            settler.cancel()
            self.ended.write_all()
        self.out.write_atomic(name + ".policy.json", self.policy.stats().model_dump_json())

    async def _on_message(self, msg: aiomqtt.Message) -> None:
        topic = str(msg.topic)
        payload = msg.payload
        assert isinstance(payload, (bytes, bytearray))
        try:
            if topic == self.topics.requests:
                await self._admit(Request.model_validate_json(payload))
            elif topic == self.topics.cancels:
                cancel = CancelRequest.model_validate_json(payload)
                await self._fail(cancel.rid, f"cancelled by the client: {cancel.reason}")
            elif topic.endswith("/events"):
                ev = parse_event(payload)
                if speaks_for(self.topics, topic, ev.worker, ev.rid):
                    await self._on_event(ev)
            elif topic.endswith("/status"):
                st = Status.model_validate_json(payload)
                if speaks_for(self.topics, topic, st.worker, None):
                    await self._on_status(st)
        except ValidationError as e:
            await self._reject(topic, bytes(payload), why_invalid(e))

    async def _publish_state(self, state: str) -> None:
        workers = {n: x.role for n, x in self.view.workers.items()} if state == "ready" else {}
        await self.publish(self.topics.router_status, RouterStatus(state=state, workers=workers,  # type: ignore[arg-type]
                                                                   policy=self.policy.describe()).dump(), retain=True)

    async def _reject(self, topic: str, payload: bytes, why: str) -> None:
        """A message failed validation, or handling it raised (``Session``): log it; fail the
        request it names (if any), nothing else."""
        rid = rid_of(payload)
        refusal(f"router: rejected a message on {topic} for {rid or 'no request'}: {why}")
        if rid is None:
            return
        reason = f"router rejected a {'request' if topic == self.topics.requests else 'message'}: {why}"
        if rid in self.inflight:
            await self._fail(rid, reason)
        elif topic == self.topics.requests:  # never admitted: the client still waits for an answer
            await self.publish(self.topics.tokens(rid), Tokens(rid=rid, start=0, tokens=[], worker="router",
                                                               t=clock.now(), done=True, error=reason).dump())

    async def _on_status(self, st: Status) -> None:
        self.liveness.on_status(st)
        if not self.ready and all(x.up for x in self.view.workers.values()):
            self.ready = True
            await self._publish_state("ready")

    async def _worker_died(self, name: str, why: str = "died") -> None:
        print(f"router: worker {name} is gone ({why})", file=sys.stderr, flush=True)
        for req in list(self.inflight.values()):
            if req.plan and name in req.plan.workers:
                await self._on_worker_death(req, name, why)

    async def _on_worker_death(self, req: RequestState, dead: str, why: str = "died") -> None:
        """What a dead worker means for one request that named it (``control.rules``)."""
        plan = req.plan
        assert plan is not None
        relay_up = plan.relay is not None and self.view.workers[plan.relay].up
        outcome = after_death(plan, req.events, dead, relay_up, req.handed_off)
        if outcome == "relay-alone":
            await self._relay_alone(req, f"worker {dead} {why}")
        elif outcome == "fail":
            await self._fail(req.rid, f"worker {dead} {why}")

    async def _relay_alone(self, req: RequestState, reason: str) -> None:
        """The main decoder cannot take over: the relay finishes the request alone (once),
        and the main decoder lets go of whatever it holds for it (a decoder whose broker
        session lapsed comes back holding it: a 30-minute soak saw it grow by gigabytes)."""
        assert req.plan is not None and req.plan.relay is not None
        if req.md_failed is not None:
            return
        req.md_failed = reason
        await self.publish(self.topics.cmd(req.plan.relay), HandoffCmd(rid=req.rid, mode="local").dump())
        await self.publish(self.topics.cmd(req.plan.decode), CancelCmd(rid=req.rid).dump())

    async def _admit(self, r: Request) -> None:
        if r.rid in self.inflight or r.rid in self.ended:
            # QoS 1 delivers at least once: a client's repeat after a broker restart must not
            # replace a request in flight nor turn a finished one into a failure.
            self.repeated_requests += 1
            print(f"router: dropped a repeated request {r.rid}", file=sys.stderr, flush=True)
            return
        if (why := out_of_bounds(r, self.cfg.vocab_size, self.cfg.max_context)) is not None:
            refusal(f"router: refused request {r.rid}: {why}")
            await self.publish(self.topics.tokens(r.rid), Tokens(rid=r.rid, start=0, tokens=[], worker="router",
                                                                 t=clock.now(), done=True,
                                                                 error=f"router refused the request: {why}").dump())
            return
        req = RequestState(r.rid, r.prompt, r.max_new, clock.monotonic(), r.hints)
        self.inflight[r.rid] = req
        self.view.weighed = [] if self.decisions.traced is not None else None
        try:
            plan = self._decided("plan", lambda: self.policy.plan(req, self.view))
            self.decisions.trace(r.rid, plan, self.view.weighed)
            commands = [(w, self._decided("decode_command", lambda w=w: self.policy.decode_command(req, plan, w)))
                        for w in plan.streamers]
            commands += [(w, DecodeCmd(rid=r.rid, prompt=r.prompt, max_new=r.max_new)) for w in plan.hold]
            if (why := unworkable(plan, self.view.workers)) is not None:
                raise PolicyFailed(f"policy {self.cfg.policy.label}: {why}")
        except (LookupError, PolicyFailed) as e:
            why = f"no plan: {e}" if isinstance(e, LookupError) else str(e)
            self.decisions.trace(r.rid, None, self.view.weighed, why)
            await self._fail(r.rid, why)
            return
        req.plan = plan
        for w in plan.workers:
            if w not in plan.hold:  # a holder only takes the KV in: not a request it serves
                self.view.workers[w].assigned += 1
            self.view.remember(w, req.prompt)  # the prompt as an array: hashed without a copy
        # Who will stream it, said before any worker is told (the client takes the request's
        # tokens from those alone: ``protocol.stream_gate``).
        streamers = sorted(plan.streamers)
        await self.publish(self.topics.tokens(r.rid), Tokens(rid=r.rid, start=0, tokens=[], worker="router",
                                                             t=clock.now(), streamers=streamers).dump())
        # Decoders first: they must know the request before its KV arrives. Each decoder and the
        # prefill (on their command topics, which only they read) get a ticket of their own for
        # this transfer: another worker of the run, which has the run's KV token and may know the
        # prompt, cannot offer the decoder this request's KV.
        targets = []
        for w, decode in commands:
            ticket = secrets.token_hex(16)
            cmd = decode.model_copy(update={"ignore_eos": r.ignore_eos, "ticket": ticket})
            await self.publish(self.topics.cmd(w), cmd.dump())
            if w in plan.hold:  # it takes the KV into its cache only (the cut-off's keep, from the start)
                await self.publish(self.topics.cmd(w), CancelCmd(rid=r.rid, keep_kv=True).dump())
            d = self.view.workers[w]
            targets.append(KVTarget(worker=d.name, host=d.host, port=d.kv_port, ticket=ticket))
        await self.publish(self.topics.cmd(plan.prefill), PrefillCmd(rid=r.rid, prompt=r.prompt, kv_to=targets,
                                                                  kv_transfer=plan.kv_transfer,
                                                                  kv_connections=plan.kv_connections).dump())

    async def _on_event(self, ev: Event) -> None:
        req = self.inflight.get(ev.rid)
        if req is None:
            if ev.rid in self.ended:  # e.g. the sender's kv_sent after the decoder's done
                rec = self.ended.records[ev.rid]
                if not in_plan(ev, rec.workers) or self._repeated(rec.events, ev):
                    return
                rec.events.append(ev)
                try:
                    self._decided("on_event", lambda: self.policy.on_event(self.ended.states[ev.rid], ev))
                except PolicyFailed as e:  # the request has ended: nothing left to fail
                    print(f"router: {e}", file=sys.stderr, flush=True)
            return
        if (req.plan is not None and not in_plan(ev, req.plan.workers)) or self._repeated(req.events, ev):
            return
        req.events.append(ev)
        try:
            await self._on_event_of(req, ev)
        except PolicyFailed as e:
            print(f"router: {e}", file=sys.stderr, flush=True)
            await self._fail(req.rid, str(e))

    async def _on_event_of(self, req: RequestState, ev: Event) -> None:
        """Carries out what the event means by the plan's rules (``control.rules.after_event``)."""
        self._decided("on_event", lambda: self.policy.on_event(req, ev))
        plan = req.plan
        step = after_event(plan, ev, req.handed_off)
        if step == "holder-lost":  # a holder's loss is its cache's, never the request's
            assert isinstance(ev, Failed)
            print(f"router: {ev.rid}: a holder did not take the KV: {ev.reason}", file=sys.stderr, flush=True)
        elif step == "relay-alone":
            assert isinstance(ev, Failed)
            await self._relay_alone(req, ev.reason)
        elif step == "fail":
            assert isinstance(ev, Failed)
            await self._fail(ev.rid, ev.reason)
        elif step == "handoff":
            assert plan is not None and plan.relay is not None
            handoff = self._decided("handoff", lambda: self.policy.handoff(req, self.view))
            await self.publish(self.topics.cmd(plan.relay), handoff.dump())
        elif step == "handed-over":
            req.handed_off = True  # the relay released it; the main decoder streams on
        elif step == "relay-finished":
            # The relay finished the request before the main decoder took over. Either cut the
            # WAN transfer off and free the main decoder's reservation, or let the KV land in
            # the main decoder's cache only (history for the session's next turn).
            assert plan is not None
            if self._decided("cut_off", lambda: self.policy.cut_off(req)):
                req.cut_off = True
                await self.publish(self.topics.cmd(plan.prefill), CancelCmd(rid=ev.rid, target=plan.decode).dump())
                await self.publish(self.topics.cmd(plan.decode), CancelCmd(rid=ev.rid).dump())
            else:
                await self.publish(self.topics.cmd(plan.decode), CancelCmd(rid=ev.rid, keep_kv=True).dump())
        if step in ("relay-finished", "done"):
            self._finish(req, None)
            await self._cache_answer(req)

    def _repeated(self, events: list[Event], ev: Event) -> bool:
        if not repeated(events, ev):
            return False
        self.repeated_events += 1
        return True

    async def _cache_answer(self, req: RequestState) -> None:
        """``cache_outputs``: the prefill instance that served a completed request computes
        the KV of its answer while idle, so the session's next turn finds it cached."""
        if self.cfg.cache_outputs and req.answer and req.plan is not None:
            cmd = WarmCmd(rid=req.rid, tokens=(req.prompt + req.answer).tolist(), start=len(req.prompt))
            await self.publish(self.topics.cmd(req.plan.prefill), cmd.dump())

    async def _fail(self, rid: str, reason: str) -> None:
        req = self.inflight.get(rid)
        if req is None:
            return
        if req.plan:
            for w in req.plan.workers:
                await self.publish(self.topics.cmd(w), CancelCmd(rid=rid).dump())
        await self.publish(self.topics.tokens(rid), Tokens(rid=rid, start=0, tokens=[], worker="router",
                                                           t=clock.now(), done=True, error=reason).dump())
        self._finish(req, reason)

    def _finish(self, req: RequestState, error: str | None) -> None:
        self.inflight.pop(req.rid, None)
        try:
            self._decided("on_end", lambda: self.policy.on_end(req, error))
        except PolicyFailed as e:  # it has ended whatever the policy makes of it
            print(f"router: {e}", file=sys.stderr, flush=True)
        plan = req.plan
        if plan:
            for w in plan.workers - set(plan.hold):
                self.view.workers[w].assigned -= 1
        w = self.view.workers
        rec = RequestRecord(rid=req.rid, md_failed=req.md_failed, cut_off=req.cut_off, error=error,
                            events=list(req.events))
        if plan:
            rec = rec.model_copy(update={
                "pipeline": plan.pipeline, "prefill": plan.prefill, "decode": plan.decode, "relay": plan.relay,
                "hold": list(plan.hold), "dcs": {x: w[x].dc for x in sorted(plan.workers)},
                "decode_dc": w[plan.decode].dc, "prefill_dc": w[plan.prefill].dc, "plan_info": plan.info})
        self.ended.add(req, rec)

    async def _sweep(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(1.0)
            n += 1
            # Memory as the workers watch theirs (``workers.allocator``): the prefix indexes
            # are the router's caches; the floor goes to a file ``testbed soak`` reads.
            WATCH.sample()
            if WATCH.trim_due():
                WATCH.trim()
            if n % MEMORY_REPORT_S == 0:
                try:
                    self.out.write_atomic(Path(self.cfg.records_path).name + ".memory.json",
                                          WATCH.report().model_dump_json())
                except OSError as e:  # a full tmpfs: the sweep (and its timeouts) goes on
                    refusal(f"router: memory report not written: {e}")
            now = clock.monotonic()  # a deadline: a step of the wall clock moves none
            for rid, req in list(self.inflight.items()):
                if now - req.arrived > self.cfg.request_timeout_s:
                    await self._fail(rid, f"timed out after {self.cfg.request_timeout_s} s")
