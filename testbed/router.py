"""Router process (datacenter a): admits requests, asks the policy for a plan, dispatches,
tracks every request in flight until it completes or fails with a reason.

Run as ``python -m testbed.router CONFIG.json`` inside the router host's namespace. It
learns worker liveness and load from their retained status messages (a worker that dies
is announced by its MQTT last will) and ends every request that depended on a dead worker,
or that exceeds the request timeout, with an explicit error to the client.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiomqtt
from pydantic import BaseModel

from testbed.policies import ClusterView, Policy, RequestState, make_policy
from testbed.policies.base import PolicyContext, WorkerView
from workers.control import QOS, Command, Event, KVTarget, Request, RouterStatus, Status, Tokens, Topics

ENDED_KEPT = 4096  # finished requests whose late events (cut-off transfers, cache-only KV) still count


class RouterConfig(BaseModel):
    run_id: str
    broker_host: str
    broker_port: int
    broker_user: str
    broker_password: str
    policy: str
    workers: dict[str, dict[str, Any]]  # name -> {role, dc, host, kv_port}
    request_timeout_s: float = 600.0
    records_path: str
    context: dict[str, Any] = {}  # PolicyContext fields


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.topics = Topics(cfg.run_id)
        self.policy: Policy = make_policy(cfg.policy)
        self.policy.bind(PolicyContext(**cfg.context))
        self.view = ClusterView({n: WorkerView(n, w["role"], w["dc"], w["host"], w["kv_port"])
                                 for n, w in cfg.workers.items()})
        self.inflight: dict[str, RequestState] = {}
        self.finished: dict[str, dict[str, Any]] = {}  # rid -> record (late events still land)
        self.ended: dict[str, RequestState] = {}  # finished requests, for the policy's late events
        self.client: aiomqtt.Client | None = None
        self.ready = False

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        assert self.client is not None
        await self.client.publish(topic, payload, qos=QOS, retain=retain)

    async def main(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with aiomqtt.Client(self.cfg.broker_host, self.cfg.broker_port, username=self.cfg.broker_user,
                                  password=self.cfg.broker_password, identifier=f"{self.cfg.run_id}-router",
                                  keepalive=5) as client:
            self.client = client
            for t in (self.topics.requests, self.topics.all_status, self.topics.events):
                await client.subscribe(t, qos=QOS)
            reader = asyncio.create_task(self._read(client))
            sweeper = asyncio.create_task(self._sweep())
            await stop.wait()
            reader.cancel()
            sweeper.cancel()
            for rid in list(self.inflight):
                await self._fail(rid, "router stopped")
            await self.publish(self.topics.router_status,
                               RouterStatus(state="stopped", workers={}, policy=self.cfg.policy).dump(), retain=True)
        tmp = Path(self.cfg.records_path + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.finished.values()))
        tmp.replace(self.cfg.records_path)
        Path(self.cfg.records_path + ".policy.json").write_text(json.dumps(self.policy.stats()))

    async def _read(self, client: aiomqtt.Client) -> None:
        async for msg in client.messages:
            topic = str(msg.topic)
            payload = msg.payload
            assert isinstance(payload, (bytes, bytearray))
            try:
                if topic == self.topics.requests:
                    await self._admit(Request.model_validate_json(payload))
                elif topic == self.topics.events:
                    await self._on_event(Event.model_validate_json(payload))
                elif topic.endswith("/status"):
                    await self._on_status(Status.model_validate_json(payload))
            except ValueError as e:
                print(f"router: bad message on {topic}: {e}", file=sys.stderr)

    async def _on_status(self, st: Status) -> None:
        w = self.view.workers.get(st.worker)
        if w is None:
            return
        was_up, w.up, w.active, w.queued = w.up, st.state == "up", st.active, st.queued
        if was_up and not w.up:
            for rid, req in list(self.inflight.items()):
                if req.plan and st.worker in req.plan.workers:
                    await self._fail(rid, f"worker {st.worker} died")
        if not self.ready and all(x.up for x in self.view.workers.values()):
            self.ready = True
            workers = {n: x.role for n, x in self.view.workers.items()}
            await self.publish(self.topics.router_status,
                               RouterStatus(state="ready", workers=workers, policy=self.policy.describe()).dump(),
                               retain=True)

    async def _admit(self, r: Request) -> None:
        req = RequestState(r.rid, len(r.prompt), r.max_new, time.time(), dict(r.meta), prompt=r.prompt)
        self.inflight[r.rid] = req
        try:
            plan = self.policy.plan(req, self.view)
        except LookupError as e:
            await self._fail(r.rid, f"no plan: {e}")
            return
        req.plan = plan
        for w in plan.workers:
            self.view.workers[w].assigned += 1
        # Decoders first: they must know the request before its KV arrives.
        targets = []
        for w in filter(None, (plan.relay, plan.decode)):
            opts = self.policy.decode_options(req, plan, w)
            await self.publish(self.topics.cmd(w), Command(op="decode", rid=r.rid, prompt=r.prompt, max_new=r.max_new,
                                                           options=opts).dump())
            d = self.view.workers[w]
            targets.append(KVTarget(worker=d.name, host=d.host, port=d.kv_port))
        await self.publish(self.topics.cmd(plan.prefill),
                           Command(op="prefill", rid=r.rid, prompt=r.prompt, max_new=r.max_new, kv_to=targets).dump())

    async def _on_event(self, ev: Event) -> None:
        req = self.inflight.get(ev.rid)
        record = {"kind": ev.kind, "worker": ev.worker, "t": ev.t, **ev.data}
        if req is None:
            if ev.rid in self.finished:  # e.g. the sender's kv_sent after the decoder's done
                self.finished[ev.rid]["events"].append(record)
                if ev.rid in self.ended:
                    self.policy.on_event(self.ended[ev.rid], ev.kind, ev.worker, ev.data)
            return
        req.events.append((ev.kind, ev.worker, ev.t))
        req.meta.setdefault("events", []).append(record)
        self.policy.on_event(req, ev.kind, ev.worker, ev.data)
        plan = req.plan
        relay = plan.relay if plan else None
        if ev.kind == "failed":
            md_lost = (plan is not None and relay is not None and not req.handed_off
                       and (ev.data.get("before_handoff") or ev.data.get("target") == plan.decode))
            if md_lost:
                # The main decoder cannot take over: the relay finishes the request alone.
                req.meta["md_failed"] = ev.data.get("reason")
                await self.publish(self.topics.cmd(relay), Command(op="handoff", rid=ev.rid,  # type: ignore[arg-type]
                                                                   options={"mode": "local"}).dump())
                return
            await self._fail(ev.rid, ev.data.get("reason", f"failed on {ev.worker}"))
        elif ev.kind == "kv_received" and plan is not None and relay and ev.worker == plan.decode:
            opts = self.policy.handoff_options(req, self.view)
            await self.publish(self.topics.cmd(relay), Command(op="handoff", rid=ev.rid, options=opts).dump())
        elif ev.kind == "done" and relay and ev.worker == relay:
            if ev.data.get("handed_off"):
                req.handed_off = True  # the relay released it; the main decoder streams on
            else:
                # The relay finished the request before the main decoder took over. Either cut
                # the WAN transfer off and free the main decoder's reservation, or let the KV
                # land in the main decoder's cache only (history for the session's next turn).
                assert plan is not None
                if self.policy.cut_off(req):
                    req.meta["cut_off"] = True
                    await self.publish(self.topics.cmd(plan.prefill),
                                       Command(op="cancel", rid=ev.rid, options={"target": plan.decode}).dump())
                    await self.publish(self.topics.cmd(plan.decode), Command(op="cancel", rid=ev.rid).dump())
                else:
                    await self.publish(self.topics.cmd(plan.decode),
                                       Command(op="cancel", rid=ev.rid, options={"keep_kv": True}).dump())
                self._finish(req, None)
        elif ev.kind == "done":
            self._finish(req, None)

    async def _fail(self, rid: str, reason: str) -> None:
        req = self.inflight.get(rid)
        if req is None:
            return
        if req.plan:
            for w in req.plan.workers:
                await self.publish(self.topics.cmd(w), Command(op="cancel", rid=rid).dump())
        await self.publish(self.topics.tokens(rid), Tokens(rid=rid, start=0, tokens=[], worker="router",
                                                           t=time.time(), done=True, error=reason).dump())
        self._finish(req, reason)

    def _finish(self, req: RequestState, error: str | None) -> None:
        self.inflight.pop(req.rid, None)
        plan = req.plan
        if plan:
            for w in plan.workers:
                self.view.workers[w].assigned -= 1
        w = self.view.workers
        rec = {"rid": req.rid, "pipeline": plan.pipeline if plan else None,
               "prefill": plan.prefill if plan else None, "decode": plan.decode if plan else None,
               "relay": plan.relay if plan else None,
               "decode_dc": w[plan.decode].dc if plan else None, "prefill_dc": w[plan.prefill].dc if plan else None,
               "plan_info": plan.info if plan else {}, "md_failed": req.meta.get("md_failed"),
               "cut_off": req.meta.get("cut_off", False),
               "error": error, "events": req.meta.get("events", [])}
        self.finished[req.rid] = rec
        self.ended[req.rid] = req
        while len(self.ended) > ENDED_KEPT:  # late events come within seconds; bound the memory
            self.ended.pop(next(iter(self.ended)))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for rid, req in list(self.inflight.items()):
                if now - req.arrived > self.cfg.request_timeout_s:
                    await self._fail(rid, f"timed out after {self.cfg.request_timeout_s} s")


if __name__ == "__main__":
    cfg = RouterConfig.model_validate_json(Path(sys.argv[1]).read_text())
    asyncio.run(Router(cfg).main())
