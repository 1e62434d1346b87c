"""Prefill worker: prefix-cache lookup, chunked prefill of the missed tokens, KV shipping.

Requests are prefilled one at a time in arrival order (chunking bounds a step's length), or,
with ``prefill_token_budget``, in passes packing chunks of several requests as serving engines
do (``_pass_loop``). The matched prefix is locked for the duration of the request so eviction
cannot pull it away; the prompt's full blocks are inserted afterwards. The KV is then shipped
to every target concurrently while the next prefill runs, or streamed as it is computed
(``kv_transfer: per-chunk``: each pass's KV once the pass ends; ``per-layer``: in layer groups
as the pass computes them; ``workers/kv_stream.py``). Transfers to one receiver take turns
(``kv_streams_per_peer`` at a time, in arrival order), streamed ones too: a streamed
transfer holds its turn while its prefill computes, and a decoder's cache holds what the
transfers before it brought when it answers the next one's HELLO (one request at a time,
that delays nobody; with packed passes a second request's transfer to the same decoder waits
for the first's last pass).
A warm command (a completed request's answer to cache) runs only when no prefill waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import torch

from protocol import clock
from protocol.messages import CancelCmd, Command, Failed, KvSent, KVTarget, PrefillCmd, PrefillDone, WarmCmd
from protocol.worker_config import STREAMED, PrefillCounters, TransferTotals, WorkerConfig, WorkerStats
from workers import kv_stream, kv_wire
from workers.kv_queue import PeerQueues
from workers.kv_stream import Computed
from workers.prefill_job import PrefillJob
from workers.radix_cache import RadixCache
from workers.runtime import Worker
from workers.transport import HOST, KvSend, Transport

WARMS_KEPT = 256  # waiting warm commands; the oldest is dropped past this (a prefill that is never idle)


class PrefillWorker(Worker):
    def __init__(self, cfg: WorkerConfig, transport: Transport = HOST) -> None:
        super().__init__(cfg, transport)
        # A hybrid model's prefill resumes only where a request's recurrent state was kept.
        self.cache: RadixCache = RadixCache(cfg.block_size, cfg.cache_tokens, keeps_kv=cfg.compute != "modeled",
                                            exact_states=cfg.cost is not None and cfg.cost.linear_layers > 0)
        self.queue: asyncio.Queue[PrefillCmd] = asyncio.Queue()
        self.warms: deque[WarmCmd] = deque()
        self.work = asyncio.Event()  # a prefill or a warm command is waiting
        self.computed_tokens = self.reused_tokens = self.warmed_tokens = self.warm_skipped = 0
        self.packed_passes = self.packed_tokens = 0
        self.transfers = TransferTotals()
        # Per request: one cancel event per KV target ("" = the request as a whole).
        self.cancels: dict[str, dict[str, asyncio.Event]] = {}
        self.pending_ships: dict[str, int] = {}  # transfers of a request still running
        self.peers = PeerQueues(cfg.kv_streams_per_peer)  # transfers to one receiver take turns
        self.kv_conns = kv_wire.Connections()  # kept open between transfers, per receiver
        self.liveness: asyncio.Server | None = None
        self.busy = 0

    async def start(self) -> None:
        # The KV port answers the router's liveness probe (decoders serve KV on theirs).
        self.liveness = await self.transport.serve_liveness(self.cfg.host_ip, self.cfg.kv_port, self.cfg.netns)
        self.spawn(self._loop())

    async def handle(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            self.cancels[cmd.rid] = {"": asyncio.Event(), **{t.worker: asyncio.Event() for t in cmd.kv_to}}
            await self.queue.put(cmd)
            self.work.set()
        elif isinstance(cmd, WarmCmd):
            if len(self.warms) == WARMS_KEPT:
                self.warms.popleft()
                self.warm_skipped += 1
            self.warms.append(cmd)
            self.work.set()
        elif isinstance(cmd, CancelCmd) and cmd.rid in self.cancels:
            # A target: cut off only the transfer to that worker (PDD's cut-off).
            for name, ev in self.cancels[cmd.rid].items():
                if cmd.target is None or name == cmd.target:
                    ev.set()

    def active(self) -> int:
        return self.busy

    def queued(self) -> int:
        return self.queue.qsize()

    def activity(self) -> tuple[int, ...]:
        return (*super().activity(), self.computed_tokens, self.reused_tokens, self.transfers.count)

    def stats(self) -> WorkerStats:
        counters = PrefillCounters(computed_tokens=self.computed_tokens, reused_tokens=self.reused_tokens,
                                   warmed_tokens=self.warmed_tokens, warm_skipped=self.warm_skipped,
                                   transfers=self.transfers, packed_passes=self.packed_passes,
                                   packed_tokens=self.packed_tokens)
        return super().stats().model_copy(update={"prefill": counters})

    async def _loop(self) -> None:
        if self.cfg.prefill_token_budget is not None:
            await self._pass_loop()
            return
        while True:
            if self.queue.empty() and not self.warms:
                self.work.clear()
                await self.work.wait()
                continue
            if self.queue.empty():
                await self._warm(self.warms.popleft())
                continue
            cmd = self.queue.get_nowait()
            self.busy = 1
            try:
                await self._prefill(cmd)
            except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
                self.cancels.pop(cmd.rid, None)
                self.emit(Failed(**self.stamp(cmd.rid), reason=f"prefill on {self.cfg.name}: {e}"))
            finally:
                self.busy = 0

    async def _warm(self, cmd: WarmCmd) -> None:
        """Compute and cache the answer's KV after its cached prompt. A prompt no longer
        cached is skipped: a write-back adds the answer, it does not recompute a context."""
        block = self.cfg.block_size
        path = self.cache.match_prefix(cmd.tokens)
        hit = len(path) * block
        if hit < (cmd.start // block) * block:  # the prompt was evicted meanwhile
            self.warm_skipped += 1
            return
        if len(cmd.tokens) - hit < block:  # no full block of the answer left to add
            return
        self.busy = 1
        self.cache.lock(path)
        try:
            cached = self.cache.blocks_of(path)
            (kv, _), real = await self.run_compute(self.runner.prefill, cmd.tokens, cached, self.cfg.prefill_chunk)
            new = len(cmd.tokens) - hit
            modeled = None if self.pacer.native else self.pacer.prefill_time(new, hit)
            await self.pace("warm", real, modeled, f"{new} answer tokens after {hit}")
            self.warmed_tokens += new
            self.cache.insert(cmd.tokens, kv, path)
        except Exception as e:  # noqa: BLE001 - nothing waits on a warm command; the worker goes on
            self.warm_skipped += 1
            print(f"{self.cfg.name}: warm {cmd.rid}: {e}", flush=True)
        finally:
            self.cache.unlock(path)
            self.busy = 0

    def _shipped(self, rid: str) -> None:
        """One transfer of ``rid`` ended; forget its cancel events after the last one."""
        self.pending_ships[rid] = self.pending_ships.get(rid, 1) - 1
        if self.pending_ships[rid] <= 0:
            self.pending_ships.pop(rid, None)
            self.cancels.pop(rid, None)

    async def _prefill(self, cmd: PrefillCmd) -> None:
        if self.cancels[cmd.rid][""].is_set():
            self.cancels.pop(cmd.rid, None)  # cancelled before it started: nothing will ship
            return
        tokens = cmd.prompt
        path = self.cache.match_to_compute(tokens)
        self.cache.lock(path)
        streamed = (cmd.kv_transfer or self.cfg.kv_transfer) in STREAMED
        try:
            cached = self.cache.blocks_of(path)  # the runner copies them in once
            hit = len(path) * self.cfg.block_size
            t0, began = clock.now(), clock.monotonic()
            (kv, first), real = await self.run_compute(self.runner.prefill, tokens, cached, self.cfg.prefill_chunk)
            modeled = None if self.pacer.native else self.pacer.prefill_time(len(tokens) - hit, hit)
            if streamed:  # each pass's KV leaves as the pass ends (the pacing below is the compute's time)
                passes = [] if self.pacer.native else self.pacer.prefill_schedule(len(tokens) - hit, hit)
                self._ship_all(cmd, kv, first, kv_stream.schedule(began, hit, passes))
            await self.pace("prefill", real, modeled, f"{len(tokens) - hit} tokens after {hit}")
            self.computed_tokens += len(tokens) - hit
            self.reused_tokens += hit
            self.cache.insert(tokens, kv, path)
        finally:
            self.cache.unlock(path)
        self.emit(PrefillDone(**self.stamp(cmd.rid), hit_tokens=hit, computed=len(tokens) - hit,
                              first_token=first, start=t0, end=clock.now(), real_s=real, modeled_s=modeled))
        if not streamed:
            self._ship_all(cmd, kv, first, None)

    # ----------------------------------------------------------------- passes packing requests
    async def _pass_loop(self) -> None:
        """Prefill passes packing several requests (``prefill_token_budget``): each pass takes
        chunks of the requests in progress, then of waiting ones, first come first served, each at
        most the device's chunk, until the budget is spent; it is priced as one pass of all of
        them (``Pacer.packed_time``). A request's real computation starts when it first gets a
        share (the compute thread runs it beside the pacing) and must be done by its last pass."""
        jobs: list[PrefillJob] = []
        s_in = self.pacer.scales.s_in
        budget = max(1, (self.cfg.prefill_token_budget or 1) // s_in)
        chunk = max(1, (self.pacer.chunk or budget * s_in) // s_in)
        while True:
            jobs = [j for j in jobs if not self._dropped(j)]
            if not jobs and self.queue.empty():
                self.busy = 0
                if self.warms:
                    await self._warm(self.warms.popleft())
                    continue
                self.work.clear()
                await self.work.wait()
                continue
            t_pass = clock.perf_counter()
            parts: list[tuple[PrefillJob, int]] = []
            left = budget
            for job in jobs:
                if left == 0:
                    break
                take = min(job.left, chunk, left)
                parts.append((job, take))
                left -= take
            while left > 0 and not self.queue.empty():
                job = self._admit(self.queue.get_nowait())
                if job is not None:
                    jobs.append(job)
                    take = min(job.left, chunk, left)
                    parts.append((job, take))
                    left -= take
            self.busy = len(jobs)
            if not parts:
                continue
            ending = [j for j, take in parts if take == j.left]
            for job in ending:  # its real computation must be done by its last pass
                with contextlib.suppress(Exception):  # a failure is the job's (``_end``)
                    await asyncio.shield(job.compute)
            real = clock.perf_counter() - t_pass
            modeled = None if self.pacer.native else self.pacer.packed_time([(n, j.hit + j.done) for j, n in parts])
            now = clock.monotonic()  # the pass began ``real`` ago and ends once paced (per-layer reads its groups)
            for job, n in (p for p in parts if p[0].computed is not None):
                job.computed.passing(job.done + n, now - real, now + max(0.0, (modeled or real) - real))  # type: ignore[union-attr]
            await self.pace("prefill", real, modeled, " + ".join(f"{n} after {j.hit + j.done}" for j, n in parts))
            self.packed_passes += 1
            self.packed_tokens += sum(n for _, n in parts) * s_in
            now = clock.monotonic()
            for job, n in parts:
                job.done += n
                job.modeled += modeled or 0.0
                if job.computed is not None:
                    job.computed.passed(job.done, now)
            for job in ending:
                jobs.remove(job)
                self._end(job)

    def _admit(self, cmd: PrefillCmd) -> PrefillJob | None:
        """A waiting request's first share of a pass: its cached prefix (locked until it ends),
        its real computation started, its streamed transfers under way."""
        if self.cancels[cmd.rid][""].is_set():
            self.cancels.pop(cmd.rid, None)  # cancelled before it started: nothing will ship
            return None
        job = PrefillJob.start(cmd, self.cache, lambda prompt, cached: self.run_compute(
            self.runner.prefill, prompt, cached, self.cfg.prefill_chunk))
        if (cmd.kv_transfer or self.cfg.kv_transfer) in STREAMED and cmd.kv_to:
            job.computed = kv_stream.Computed(job.began, job.hit, final=False)
            self.spawn(self._ship_computed(job))
        return job

    async def _ship_computed(self, job: PrefillJob) -> None:
        """A streamed request's transfers, once its KV exists (at once when modeled)."""
        try:
            (kv, first), _ = await asyncio.shield(job.compute)
        except Exception:  # noqa: BLE001 - the job fails at its last pass (``_end``)
            if job.dropped:  # no last pass will come: nothing will ship
                self.cancels.pop(job.cmd.rid, None)
            return
        self._ship_all(job.cmd, kv, first, job.computed)

    def _dropped(self, job: PrefillJob) -> bool:
        """A request cancelled while in progress: it leaves the passes, its prefix unlocked."""
        cancel = self.cancels.get(job.cmd.rid, {}).get("")
        if cancel is None or not cancel.is_set():  # checked before every pass: no allocation here
            return False
        self.cache.unlock(job.path)
        job.dropped = True
        if job.computed is None:
            self.cancels.pop(job.cmd.rid, None)
        return True

    def _end(self, job: PrefillJob) -> None:
        """A request's last pass ended: its KV cached, PrefillDone, its transfers (unless streamed)."""
        cmd, tokens = job.cmd, job.cmd.prompt
        try:
            kv, first, real = job.finish(self.cache)
        except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
            self.cancels.pop(cmd.rid, None)
            self.emit(Failed(**self.stamp(cmd.rid), reason=f"prefill on {self.cfg.name}: {e}"))
            return
        new = len(tokens) - job.hit
        self.computed_tokens += new
        self.reused_tokens += job.hit
        self.emit(PrefillDone(**self.stamp(cmd.rid), hit_tokens=job.hit, computed=new, first_token=first,
                              start=job.t0, end=clock.now(), real_s=real,
                              modeled_s=None if self.pacer.native else job.modeled))
        if job.computed is None:
            self._ship_all(cmd, kv, first, None)

    def _ship_all(self, cmd: PrefillCmd, kv: torch.Tensor, first: int, computed: Computed | None) -> None:
        """Ship the KV to every target (``computed``: streamed, each frame once computed)."""
        self.pending_ships[cmd.rid] = len(cmd.kv_to)
        if not cmd.kv_to:
            self.cancels.pop(cmd.rid, None)
        for target in cmd.kv_to:
            self.spawn(self._ship(cmd, target, kv, first, computed))

    async def _ship(self, cmd: PrefillCmd, target: KVTarget, kv: torch.Tensor, first: int,
                    computed: Computed | None = None) -> None:
        corrupt, mode = self.cfg.faults.corrupt_block, cmd.kv_transfer or self.cfg.kv_transfer
        events = self.cancels[cmd.rid]
        cancel = asyncio.Event()

        async def relay_cancel() -> None:  # either the whole request or this target
            waits = [asyncio.ensure_future(events[k].wait()) for k in ("", target.worker)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when the transfer ended first and this watcher is cancelled
                for w in waits:
                    w.cancel()
            cancel.set()

        watcher = asyncio.ensure_future(relay_cancel())
        queued = clock.now()
        try:
            if not await self.peers.turn(target.worker, cancel):
                self._count_transfer(0, cancelled=True)
                self.emit(KvSent(**self.stamp(cmd.rid), to=target.worker, bytes=0, written=0, payload=0,
                                 planned_payload=0, tokens=0, had=0, start=queued, end=clock.now(),
                                 queued_s=clock.now() - queued, cancelled=True))
                return
            waited = clock.now() - queued
            try:
                opts = KvSend(cancel=cancel, corrupt_block=corrupt, token=self.cfg.kv_token, pool=self.kv_conns,
                              zeros=self.cfg.compute == "modeled", netns=self.cfg.netns,
                              timeout_s=self.cfg.kv_read_timeout_s, ticket=target.ticket,
                              state_bytes=self.cfg.kv_state_bytes, computed=computed,
                              connections=cmd.kv_connections or self.cfg.kv_connections,
                              layer_groups=self.cfg.kv_layer_groups if mode == "per-layer" else 1)
                st = await self.transport.send_kv(target.host, target.port, cmd.rid, cmd.prompt, kv, first,
                                                  self.cfg.block_size, opts)
            finally:
                self.peers.release(target.worker)
        except Exception as e:  # noqa: BLE001 - that transfer's request fails, never the worker
            why = str(e) if isinstance(e, kv_wire.KVTransferError) else f"{type(e).__name__}: {e}"
            self.emit(Failed(**self.stamp(cmd.rid), reason=f"KV transfer to {target.worker}: {why}",
                             target=target.worker))
            return
        finally:
            watcher.cancel()
            self._shipped(cmd.rid)
        self._count_transfer(st.bytes_acked, st.cancelled)
        self.emit(KvSent(**self.stamp(cmd.rid), to=target.worker, bytes=st.bytes_acked, written=st.bytes_sent,
                         payload=st.payload_bytes, planned_payload=st.planned_payload, tokens=st.tokens_sent,
                         had=st.receiver_had, start=st.start, end=st.end, queued_s=waited, cancelled=st.cancelled,
                         in_flight=st.bytes_in_flight))

    def _count_transfer(self, nbytes: int, cancelled: bool) -> None:
        t = self.transfers
        self.transfers = TransferTotals(count=t.count + 1, bytes=t.bytes + nbytes,
                                        cancelled=t.cancelled + int(cancelled))
