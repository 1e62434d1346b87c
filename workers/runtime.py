"""Worker process runtime: MQTT session, status/last-will, command dispatch, statistics.

A worker is one process inside its host's namespace (``python -m workers CONFIG.json``,
``workers/__main__.py``). Role-specific behaviour lives in ``PrefillWorker`` /
``DecodeWorker``; this module gives both the same life: connect to the broker with a last
will (``dead``), publish a retained ``up`` status with its load, hand each validated
command to ``handle``, and run torch work on one dedicated thread so the event loop keeps
serving the network while the model computes. A command that fails validation is logged
and fails only the request it names (a ``Failed`` event); the worker serves on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import sys
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiomqtt
import torch
from pydantic import ValidationError

from protocol import clock, token_stream
from protocol.messages import (
    QOS,
    Command,
    DecodeCmd,
    Event,
    Failed,
    PrefillCmd,
    Status,
    parse_command,
    rid_of,
    why_invalid,
)
from protocol.mqtt_session import Session, keepalive_for
from protocol.refusals import refusal
from protocol.token_stream import TokenChunk
from protocol.topics import Topics
from protocol.worker_config import CacheReport, ModelCost, WorkerConfig, WorkerStats
from workers.allocator import WATCH
from workers.device import Pacer, make_pacer
from workers.modeled import ModeledRunner
from workers.privilege import OutDir
from workers.radix_cache import RadixCache
from workers.transport import HOST, Transport

if TYPE_CHECKING:  # transformers: imported only where a model runs (``workers.model_config``)
    from workers.model import ModelRunner

T = TypeVar("T")

STATUS_PERIOD_S = 0.5
WAKE_LEAD_MAX_S = 0.002
REMEMBERED_STARTS = 100_000  # request ids whose start command a worker remembers, to drop repeats


def _runner(cfg: WorkerConfig) -> ModelRunner | ModeledRunner:
    if cfg.compute == "modeled":
        return ModeledRunner(cfg.model_path, cfg.dtype)
    # Here, not at the top: transformers takes ~2.5 s and ~150 MB to import, which a modeled
    # worker (every simulated one) would pay for a model it never runs.
    from workers.model import ModelRunner

    return ModelRunner(cfg.model_path, cfg.dtype, cfg.threads)


class Worker:
    def __init__(self, cfg: WorkerConfig, transport: Transport = HOST) -> None:
        self.cfg = cfg
        self.transport = transport  # the broker and KV peers: the host's network or a simulator's
        self.topics = Topics(cfg.run_id)
        self.runner: ModelRunner | ModeledRunner = _runner(cfg)
        # Steps are priced as the emulated model's; without one, as the real model's own work.
        self.pacer: Pacer = make_pacer(cfg.device, cfg.cost or self._own_cost(), cfg.scales)
        self.wake_lead = 0.0  # how early a paced wait is set to wake (see ``pace``)
        self.cache: RadixCache | None = None  # a role with a prefix cache sets it
        self.compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch")
        # The emulated device runs one forward pass at a time: a step holds it for its real
        # compute and its pacing wait, so an extend waits for the decode step in flight (as
        # on an accelerator) and its overrun counts only its own compute.
        self.device = asyncio.Lock()
        self.session: Session | None = None
        self.stopping = asyncio.Event()
        self.crashed: str | None = None  # why a task of this worker failed (the worker then ends)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.outbox: list[TokenChunk] = []  # token chunks of the step in progress (``stream``)
        self.cache_series: list[tuple[float, int, int]] = []  # (t, hit tokens, lookup tokens)
        self.started: OrderedDict[tuple[str, str], None] = OrderedDict()  # (command, request) begun, oldest first
        self.repeated_commands = 0
        # Opened while privileged: once it has dropped root, the worker writes only here.
        self.out = OutDir(Path(cfg.stats_path).parent) if cfg.stats_path else None

    def _own_cost(self) -> ModelCost | None:
        """The real model's own work (a scenario that emulates no model); modeled compute
        has no model of its own and is always given the emulated one."""
        if isinstance(self.runner, ModeledRunner):
            return None
        mc = self.runner.model.config
        return ModelCost(
            params=self.runner.params, layers=mc.num_hidden_layers, hidden=mc.hidden_size,
            kv_bytes_per_token=self.runner.shape.kv_bytes_per_token,
            weight_bytes=self.runner.params * torch.finfo(self.runner.shape.dtype).bits // 8,
            dtype_bytes=torch.finfo(self.runner.shape.dtype).bits // 8,
        )  # fmt: skip

    # ----------------------------------------------------------------- helpers for roles
    async def run_compute(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """Run torch work on the compute thread; returns (result, real seconds). A modeled
        worker's step (lengths and zeros, ~0.2 ms) runs here on the loop: handing it to the
        thread and back costs two wake-ups, more than the step."""
        t0 = clock.perf_counter()
        if self.cfg.compute == "modeled":
            res = fn(*args)
        else:
            res = await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)
        return res, clock.perf_counter() - t0

    async def pace(self, kind: str, real_s: float, modeled_s: float | None, detail: str = "") -> None:
        wait = self.pacer.account(kind, real_s, modeled_s, detail)
        if wait > 0:
            # A timer wakes a little after it is due (the loop, the kernel's timer slack, the
            # scheduler): ~0.2 ms here. Waking that much early, learnt from the last wake-ups,
            # ends the typical step on time; what is left is judged (``Pacer.woke``).
            sleep = max(0.0, wait - self.wake_lead)
            t0 = clock.perf_counter()
            await asyncio.sleep(sleep)
            slept = clock.perf_counter() - t0
            self.wake_lead = min(WAKE_LEAD_MAX_S, 0.9 * self.wake_lead + 0.1 * max(0.0, slept - sleep))
            self.pacer.woke(modeled_s or 0.0, slept - wait)

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        assert self.session is not None
        await self.session.publish(topic, payload, retain=retain)

    def stamp(self, rid: str) -> dict[str, Any]:
        """The fields every event carries: request, this worker, now."""
        return {"rid": rid, "worker": self.cfg.name, "t": clock.now()}

    # Events, tokens and commands are published without waiting for the broker's
    # acknowledgement: a QoS-1 ack is a round trip to the broker (across the WAN from
    # datacenter b), and no decode step, first token or handoff may wait for one. Publishes
    # are issued in the order these are called (each task hands its packet to the client
    # before it awaits; buffered tokens go out before any event or command that follows
    # them), so a request's stream and a worker's events stay in order.
    def emit(self, event: Event) -> None:
        self.send(self.topics.events(self.cfg.name), event.dump())

    def send(self, topic: str, payload: bytes) -> None:
        """Publish without waiting, after the tokens buffered so far."""
        self.flush_tokens()
        self.spawn(self.publish(topic, payload))

    def stream(self, rid: str, start: int, tokens: list[int], done: bool = False, error: str | None = None) -> None:
        """Buffer a chunk of ``rid``'s output; the chunks of one step leave together as one
        batch (``protocol/token_stream.py``) once the step's code yields to the loop."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self.flush_tokens)
        self.outbox.append(TokenChunk(rid, start, tokens, self.cfg.name, done, error))

    def flush_tokens(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            for i in range(0, len(batch), token_stream.MAX_CHUNKS):
                payload = token_stream.encode(self.cfg.name, clock.now(), batch[i : i + token_stream.MAX_CHUNKS])
                self.spawn(self.publish(self.topics.stream(self.cfg.name), payload))

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A task that raised is a bug, and a worker that carried on without it (a dead decode
        loop) would hold its requests until they time out: the worker ends at once instead,
        says so, and its dead status fails its requests at the router."""
        self.tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        traceback.print_exception(exc, file=sys.stderr)
        if self.crashed is None:
            self.crashed = f"{task.get_coro().__qualname__}: {type(exc).__name__}: {exc}"  # type: ignore[union-attr]
            print(f"{self.cfg.name}: task failed ({self.crashed}); the worker ends", file=sys.stderr, flush=True)
        self.stopping.set()

    def status(self) -> Status:
        return Status(worker=self.cfg.name, role=self.cfg.role, state="up", active=self.active(),
                      queued=self.queued(), host=self.cfg.host_ip, kv_port=self.cfg.kv_port,
                      cache_hit_rate=self.cache.hit_rate if self.cache is not None else None)

    async def publish_status(self, st: Status | None = None) -> None:
        await self.publish(self.topics.status(self.cfg.name), (st or self.status()).dump(), retain=True)

    # ----------------------------------------------------------------- role interface
    async def start(self) -> None:
        """Role setup once connected (e.g. start the KV server)."""

    async def handle(self, cmd: Command) -> None:
        raise NotImplementedError

    PEERS = False  # whether other workers send this role commands (decoders: the handoff)

    def peer_refusal(self, sender: str, cmd: Command) -> str | None:
        """Why a command worker ``sender`` sent this one is refused (None: taken)."""
        return f"{self.cfg.role} takes no command from another worker"

    @property
    def nbytes(self) -> int:
        """KV this worker holds outside its cache (roles that keep some say how much)."""
        return 0

    def active(self) -> int:
        return 0

    def queued(self) -> int:
        return 0

    def activity(self) -> tuple[int, ...]:
        """Counters that change whenever this worker's statistics do (roles add theirs): the
        statistics file is rewritten only when they moved."""
        c = self.cache
        return (self.pacer.steps, self.active(), self.queued(), self.repeated_commands, len(self.cache_series),
                c.lookup_tokens if c is not None else 0)

    def stats(self) -> WorkerStats:
        """This worker's statistics file; roles add their counters."""
        return WorkerStats(worker=self.cfg.name, role=self.cfg.role, compute=self.cfg.compute,
                           device=self.pacer.report(), cache=self.cache_report(),
                           repeated_commands=self.repeated_commands, memory=WATCH.report())

    def cache_report(self) -> CacheReport | None:
        """Prefix-cache counters and their history (sampled each second when they change)."""
        c = self.cache
        if c is None:
            return None
        return CacheReport(hit_rate=c.hit_rate, blocks=c.blocks, hit_tokens=c.hit_tokens,
                           lookup_tokens=c.lookup_tokens, evicted_blocks=c.evicted_blocks,
                           state_miss_tokens=c.state_miss_tokens, series=list(self.cache_series))

    def _sample_cache(self) -> None:
        c = self.cache
        if c is None or len(self.cache_series) >= 7200:
            return
        if not self.cache_series or self.cache_series[-1][2] != c.lookup_tokens:
            self.cache_series.append((round(clock.now(), 3), c.hit_tokens, c.lookup_tokens))

    # ----------------------------------------------------------------- main loop
    def warm_up(self) -> None:
        """One small prefill, decode step and extend on the compute thread before the worker
        reports itself up: a first call pays one-time costs (the thread, first allocations,
        kernel selection) that would otherwise land in the first paced steps (a modeled 3 ms
        prefill took 7-30 ms in a fresh process)."""
        kv, first = self.runner.prefill(list(range(3, 3 + 2 * self.cfg.block_size)), None, self.cfg.prefill_chunk)
        self.runner.batch([kv]).step([first])
        self.runner.extend(kv, [first])

    async def main(self, signals: bool = True) -> None:
        """Serve until stopped (SIGTERM/SIGINT when ``signals``; a process hosting several
        workers installs one handler for all instead)."""
        await self.run_compute(self.warm_up)
        if signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stopping.set)
        dead = Status(worker=self.cfg.name, role=self.cfg.role, state="dead").dump()
        will = aiomqtt.Will(self.topics.status(self.cfg.name), dead, qos=QOS, retain=True)
        b = self.cfg.broker
        identifier = f"{self.cfg.run_id}-{self.cfg.name}"
        with contextlib.suppress(aiomqtt.MqttError):  # no broker yet: the session below reports it
            await self.transport.discard_session(b, identifier)
        client = self.transport.mqtt_client(b, identifier, keepalive_for(self.cfg.scales.dilation), will)
        subscriptions = [self.topics.cmd(self.cfg.name)]
        if self.PEERS:
            subscriptions.append(self.topics.peers_of(self.cfg.name))
        self.session = Session(client, subscriptions, self.cfg.name)
        self.session.on_error = self._on_bad_message

        async def on_connect(first: bool) -> None:
            if first:
                await self.start()
                self.spawn(self._status_loop())
            await self.publish_status()  # retained: a restarted broker may have lost it

        async def on_stop() -> None:
            self.flush_tokens()
            self._sample_cache()
            self.write_stats()
            await self.publish(self.topics.status(self.cfg.name), dead, retain=True)

        await self.session.run(self._on_message, on_connect, self.stopping, on_stop)
        if self.crashed is not None:
            raise SystemExit(f"{self.cfg.name}: {self.crashed}")

    async def _on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload
        assert isinstance(payload, (bytes, bytearray))
        topic = str(message.topic)
        peer = self.topics.peer(self.cfg.name, "")
        sender = topic[len(peer):] if topic.startswith(peer) else None  # the topic says who (the ACL)
        try:
            cmd = parse_command(payload)
        except ValidationError as e:
            if sender is None:
                self.reject(payload, why_invalid(e))
            else:  # a peer cannot fail a request it may not be part of: logged only
                refusal(f"{self.cfg.name}: refused a message from {sender}: {why_invalid(e)}")
            return
        if sender is not None and (why := self.peer_refusal(sender, cmd)) is not None:
            refusal(f"{self.cfg.name}: refused a {cmd.op} for {cmd.rid} from {sender}: {why}")
            return
        if self.first_delivery(cmd):
            self.spawn(self._handle(str(message.topic), cmd))

    async def _handle(self, topic: str, cmd: Command) -> None:
        """One command: an exception while handling it fails its request, not the worker (a
        task that raises ends the worker: ``_task_done``)."""
        try:
            await self.handle(cmd)
        except Exception as e:  # noqa: BLE001 - logged with the traceback, the request fails
            traceback.print_exception(e, limit=-4, file=sys.stderr)
            self.reject(cmd.dump(), f"handling its {cmd.op} on {topic} raised {type(e).__name__}: {e}")

    async def _on_bad_message(self, topic: str, payload: bytes, why: str) -> None:
        self.reject(payload, why)

    def first_delivery(self, cmd: Command) -> bool:
        """False for a repeat of a command that starts a request here. QoS 1 delivers at
        least once: after a broker restart a publisher resends what the broker had not
        acknowledged, which the worker may already have taken. A second ``PrefillCmd`` would
        compute and ship the KV again; a second ``DecodeCmd`` would replace the request's
        state mid-flight (a transfer already matched against the cached prefix would land
        on a state without it, and decode from the wrong KV). The other commands are
        idempotent where they are handled."""
        if not isinstance(cmd, PrefillCmd | DecodeCmd):
            return True
        key = (cmd.op, cmd.rid)  # a colocated worker takes both commands of a request
        if key in self.started:
            self.repeated_commands += 1
            print(f"{self.cfg.name}: dropped a repeated {cmd.op} for {cmd.rid}", file=sys.stderr, flush=True)
            return False
        self.started[key] = None
        if len(self.started) > REMEMBERED_STARTS:
            self.started.popitem(last=False)
        return True

    def reject(self, payload: bytes | bytearray, why: str) -> None:
        """A command failed validation or could not be handled: log it and fail the request
        it names, if any."""
        rid = rid_of(payload)
        refusal(f"{self.cfg.name}: rejected a command for {rid or 'no request'}: {why}")
        if rid is not None:
            self.emit(Failed(**self.stamp(rid), reason=f"{self.cfg.name} rejected a command: {why}"))

    async def _status_loop(self) -> None:
        """Every STATUS_PERIOD_S, the status (retained: what the router routes on) and the
        statistics file, each only when it changed. A quiet worker then costs nothing per
        wall second, which a dilated run would pay D times per emulated second (the
        router's largest cost in a 16-instance cluster was decoding unchanged statuses)."""
        n = 0
        published: Status | None = None
        written: tuple[int, ...] | None = None
        while True:
            await asyncio.sleep(STATUS_PERIOD_S)
            n += 1
            if n % 2 == 0:
                self._sample_cache()
            if self.cache is not None:
                WATCH.add_holder(self.cache)
            WATCH.add_holder(self)
            WATCH.sample()
            if WATCH.trim_due():  # on the compute thread: between steps
                await asyncio.get_running_loop().run_in_executor(self.compute, WATCH.trim)
            st = self.status()
            if st != published:
                await self.publish_status(st)
                published = st
            if (now := self.activity()) != written:
                try:
                    self.write_stats()
                    written = now
                except OSError as e:  # a full tmpfs, say: the worker serves on; the next period tries again
                    refusal(f"{self.cfg.name}: statistics not written: {e}")

    def write_stats(self) -> None:
        if self.out is not None:
            # 0640: the folder's group is the serve front end's, whose /metrics reads it.
            self.out.write_atomic(Path(self.cfg.stats_path).name, self.stats().model_dump_json(), 0o640)
