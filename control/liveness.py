"""The router's failure detector: which workers are up, and when a worker is dead.

A worker says "up" (retained) while it serves; its MQTT last will says "dead" when its broker
session ends. ``Liveness`` turns that news into a verdict (``Liveness.on_status``):

* ``probe`` (the default): a "dead" is confirmed before it is acted on. A broker restart sends
  every client's will; the router waits out ``WILL_SETTLE_S`` and a restart's grace first.
  Then it probes the worker's host: a refused connection means the process is gone (dead at
  once, typically ~0.3 emulated s after the kill); no answer means the host is unreachable (a
  WAN outage lapsed its session): it gets no new requests, keeps the ones it holds, and is
  probed again until it says "up" (they resume) or ``unreachable_grace_s`` has passed (dead).
* ``none``: statuses other than "up" are ignored, as a router without health checks: a dead
  worker stays in rotation and its requests end only by their own timeouts (a KV transfer's,
  the request's). The baseline of the PD-outage comparison (docs/faults.md).

Every death is appended to ``<records>.deaths.jsonl`` as it is declared (``WorkerDeath``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from protocol import clock
from protocol.messages import Status
from protocol.mqtt_session import Session
from protocol.router_config import RouterConfig, WorkerDeath
from testbed.policies.base import WorkerView
from workers.privilege import OutDir

# Emulated seconds (x the dilation, as every timer of the router):
WILL_SETTLE_S = 0.3  # a worker's death is acted on this long after its will (a broker restart shows first)
RESTART_GRACE_S = 3.0  # after the router reconnects, how long a worker has to say "up" again
PROBE_TIMEOUT_S = 0.5  # a worker's host that answers no connection within this is unreachable
PROBE_EVERY_S = 1.0  # how often an unreachable worker is probed again

OnDead = Callable[[str, str], Awaitable[None]]  # (worker, why)
Probe = Callable[[str, int, float], Awaitable[str]]  # (host, port, timeout) -> refused | no answer | alive


class Liveness:
    def __init__(self, cfg: RouterConfig, workers: dict[str, WorkerView], on_dead: OnDead, out: OutDir,
                 probe: Probe) -> None:
        self.cfg, self.workers, self.on_dead, self.out = cfg, workers, on_dead, out
        self._probe = probe  # the router's transport's
        self.session: Session | None = None  # the router's, once connected
        self.last_up: dict[str, float] = {}  # worker -> clock.monotonic() of its last "up" status
        self.suspects: set[str] = set()  # workers whose "dead" status is being confirmed
        self.unreachable: dict[str, float] = {}  # worker -> since (monotonic): requests kept, none routed
        self.pending: set[asyncio.Task[None]] = set()
        self.deaths_name = Path(cfg.records_path).name + ".deaths.jsonl"

    def on_status(self, st: Status) -> None:
        w = self.workers.get(st.worker)
        if w is None:
            return
        if st.state == "up":
            w.up, w.active, w.queued = True, st.active, st.queued
            self.last_up[st.worker] = clock.monotonic()
        elif self.cfg.failure_detection == "probe" and w.up and st.worker not in self.suspects:
            # Still routable until confirmed: a request planned onto it meanwhile fails with
            # the others if the death is real.
            self.suspects.add(st.worker)
            task = asyncio.create_task(self._confirm_death(st.worker, clock.monotonic(), clock.now()))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _confirm_death(self, name: str, news_at: float, news_t: float) -> None:
        """See the module docstring (``probe``). A broker that shuts down sends the will of
        every client, live workers included, just before it drops the router too (and a
        restarted one hands the retained wills out again): if the router's connection goes
        within WILL_SETTLE_S, or came back within RESTART_GRACE_S, the worker has until
        RESTART_GRACE_S after the reconnection to say "up" again."""
        session = self.session
        assert session is not None
        d = self.cfg.dilation
        losses = session.losses
        await asyncio.sleep(WILL_SETTLE_S * d)
        if (session.losses != losses or not session.connected.is_set()
                or session.since_reconnect() < RESTART_GRACE_S * d):
            await session.connected.wait()
            await asyncio.sleep(max(0.0, RESTART_GRACE_S * d - session.since_reconnect()))
        w = self.workers[name]
        deadline = clock.monotonic() + self.cfg.unreachable_grace_s
        why = "died"
        while self.last_up.get(name, 0.0) <= news_at:  # no "up" since the news
            answer = await self.probe(w)
            if answer == "refused":
                break
            if clock.monotonic() >= deadline:
                why = f"unreachable for {self.cfg.unreachable_grace_s / d:g} s"
                break
            if name not in self.unreachable:
                self.unreachable[name] = clock.monotonic()
                w.up = False  # no new requests; those it holds wait for the line
                print(f"router: worker {name} is unreachable ({answer}); its requests wait", file=sys.stderr,
                      flush=True)
            await asyncio.sleep(PROBE_EVERY_S * d)
        self.suspects.discard(name)
        since = self.unreachable.pop(name, None)
        if self.last_up.get(name, 0.0) > news_at:
            if since is not None:
                print(f"router: worker {name} is back after {(clock.monotonic() - since) / d:.1f} s", file=sys.stderr,
                      flush=True)
            return
        w.up = False
        death = WorkerDeath(worker=name, news_t=news_t, t=clock.now(), why=why)
        self.out.append_line(self.deaths_name, death.model_dump_json())  # one line per death, as it happens
        await self.on_dead(name, why)

    async def probe(self, w: WorkerView) -> str:
        """"refused" when the worker's host answers that nothing listens on its port (the
        process is gone), "no answer" when it does not answer in time, else "alive"."""
        return await self._probe(w.host, w.kv_port, PROBE_TIMEOUT_S * self.cfg.dilation)
