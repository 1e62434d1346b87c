"""Colocated worker: one instance that prefills and decodes, as vLLM and SGLang run by default
(no disaggregation; the ``colocated`` policy).

Each step is one forward pass over a decode token of every running request and chunks of
waiting prompts, first come first served, up to ``prefill_token_budget`` emulated tokens
together (decode tokens count first: mixed batches with chunked prefill), priced by the
device model as that pass (``Pacer.mixed_time``; a step without decodes is a prefill pass of
the whole budget). A prompt's prefix cache is this instance's own: its prefill resumes from
it and the KV it computes stays in it. A request decodes from the step after its last chunk,
when its first token is streamed: its TTFT holds its wait behind the running requests'
decodes, the cost disaggregation removes.

Admission: a prompt starts prefilling only when the instance has a batch row and KV room
(``kv_capacity_tokens``: prompt and output) for it beside the running requests and those
prefilling; otherwise it waits, in arrival order.

The router sends a request to it as to a disaggregated pair (``Plan`` naming it as prefill
and main decoder): the decode command, then the prefill command naming this worker as the
KV's only receiver. The KV never leaves; ``KvReceived`` says what the cache held, with no
bytes. A completed request's answer (``WarmCmd``, ``cache_outputs``) is cached at once and
costs no device time: the instance decoded it and holds its KV (with a real model the KV of
the answer the trace names is computed on the compute thread, unpaced).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from protocol import clock
from protocol.messages import CancelCmd, Command, DecodeCmd, KvReceived, PrefillCmd, PrefillDone, WarmCmd
from protocol.worker_config import PrefillCounters, WorkerConfig, WorkerStats
from workers.decode import DecodeWorker
from workers.modeled import ModeledRunner
from workers.prefill_job import PrefillJob
from workers.radix_cache import RadixCache
from workers.transport import HOST, Transport

# Emulated tokens a pass when the scenario sets no prefill_token_budget: vLLM's
# max_num_batched_tokens and SGLang's chunked_prefill_size on this class of GPU.
DEFAULT_BUDGET = 8192


class ColocatedWorker(DecodeWorker):
    def __init__(self, cfg: WorkerConfig, transport: Transport = HOST) -> None:
        super().__init__(cfg, transport)
        # The prefill's cache: a hybrid model's prefill resumes only where a state was kept.
        self.cache = RadixCache(cfg.block_size, cfg.cache_tokens, keeps_kv=cfg.compute != "modeled",
                                exact_states=cfg.cost is not None and cfg.cost.linear_layers > 0)
        self.prompts: deque[PrefillCmd] = deque()  # waiting for room, in arrival order
        self.jobs: list[PrefillJob] = []  # prefilling
        self.budget = cfg.prefill_token_budget or DEFAULT_BUDGET
        self.computed_tokens = self.reused_tokens = self.warmed_tokens = 0
        self.mixed_passes = self.mixed_prompt_tokens = 0

    def active(self) -> int:
        return len(self.running) + len(self.jobs)

    def queued(self) -> int:
        return super().queued() + len(self.prompts)

    def kv_in_use(self) -> int:
        return super().kv_in_use() + sum(len(j.cmd.prompt) + self._max_new(j.cmd.rid) for j in self.jobs)

    def _max_new(self, rid: str) -> int:
        seq = self.waiting.get(rid)
        return seq.max_new if seq is not None else 0

    def stats(self) -> WorkerStats:
        counters = PrefillCounters(computed_tokens=self.computed_tokens, reused_tokens=self.reused_tokens,
                                   warmed_tokens=self.warmed_tokens, packed_passes=self.mixed_passes,
                                   packed_tokens=self.mixed_prompt_tokens)
        return super().stats().model_copy(update={"prefill": counters})

    async def handle(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            if [t.worker for t in cmd.kv_to] != [self.cfg.name] or cmd.rid not in self.waiting:
                await self.fail(cmd.rid, f"{self.cfg.name} is colocated: it prefills only the requests it decodes")
                return
            self.prompts.append(cmd)
            self.wake.set()
        elif isinstance(cmd, WarmCmd):
            await self._cache_answer(cmd)
        else:
            await super().handle(cmd)
            if isinstance(cmd, DecodeCmd) and (seq := self.waiting.get(cmd.rid)) is not None:
                seq.stop_kv_deadline()  # its KV is computed here: the router's timeout bounds the wait
            if isinstance(cmd, CancelCmd):
                self.wake.set()  # a prompt waiting for room may fit now

    async def _cache_answer(self, cmd: WarmCmd) -> None:
        path = self.cache.match_prefix(cmd.tokens)
        if len(path) * self.cfg.block_size < (cmd.start // self.cfg.block_size) * self.cfg.block_size:
            return  # the prompt was evicted meanwhile: nothing to extend
        if isinstance(self.runner, ModeledRunner):
            kv = self.runner.kv(len(cmd.tokens))
        else:
            self.cache.lock(path)
            try:
                (kv, _), _ = await self.run_compute(self.runner.prefill, cmd.tokens, self.cache.blocks_of(path),
                                                    self.cfg.prefill_chunk)
            finally:
                self.cache.unlock(path)
        self.warmed_tokens += len(cmd.tokens) - len(path) * self.cfg.block_size
        self.cache.insert(cmd.tokens, kv, path)

    # ----------------------------------------------------------------- mixed steps
    def _admit_prompts(self) -> None:
        """Waiting prompts start prefilling, oldest first, while a batch row and KV room are free."""
        cap = self.cfg.kv_capacity_tokens
        while self.prompts:
            cmd = self.prompts[0]
            seq = self.waiting.get(cmd.rid)
            if seq is None:  # cancelled while it waited
                self.prompts.popleft()
                continue
            need = seq.prompt_len + seq.max_new
            if cap is not None and need > cap:
                self.prompts.popleft()
                self.spawn(self.fail(cmd.rid, f"{need} tokens of KV exceed {self.cfg.name}'s capacity of {cap}"))
                continue
            if len(self.running) + len(self.jobs) >= self.cfg.max_batch or (
                    cap is not None and self.kv_in_use() + need > cap):
                return
            self.prompts.popleft()
            self.jobs.append(PrefillJob.start(cmd, self.cache, lambda prompt, cached: self.run_compute(
                self.runner.prefill, prompt, cached, self.cfg.prefill_chunk)))

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.jobs if j.cmd.rid not in self.waiting]:
            self.jobs.remove(job)
            self.cache.unlock(job.path)
            job.dropped = True

    async def _loop(self) -> None:
        s = self.pacer.scales
        chunk = self.pacer.chunk or self.budget
        while True:
            self._drop_cancelled()
            self._admit_prompts()
            if not self._decodable() and not self.jobs:
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.device:
                t_step = clock.perf_counter()
                batch = self._decodable()
                passes = s.s_out if batch else 1
                room = self.pacer.mixed_room(len(batch), self.budget)
                parts: list[tuple[PrefillJob, int]] = []
                for job in self.jobs:
                    if room == 0:
                        break
                    take = min(job.left, max(1, chunk * passes // s.s_in), room)
                    parts.append((job, take))
                    room -= take
                if not batch and not parts:
                    continue
                ending = [j for j, take in parts if take == j.left]
                for job in ending:  # its real computation must be done by its last pass
                    with contextlib.suppress(Exception):  # a failure is the job's (``_prefilled``)
                        await asyncio.shield(job.compute)
                results, detail = [], ""
                if batch:
                    results, _, detail = await self._decode_step(batch)
                real = clock.perf_counter() - t_step
                modeled, ends = None, [0.0] * len(parts)
                if not self.pacer.native:
                    modeled, ends = self.pacer.mixed_time([q.n for q in batch], [(n, j.hit + j.done) for j, n in parts],
                                                          self.budget)
                began = clock.monotonic() - real
                for (job, _), end in zip(parts, ends, strict=True):
                    if job in ending:  # its first token is due at the end of its last pass, not of the step
                        self.spawn(self._prefilled_at(job, began + end))
                kind = "decode" if not parts else "mixed" if batch else "prefill"
                prompts = " + ".join(f"{n} after {j.hit + j.done}" for j, n in parts)
                await self.pace(kind, real, modeled, "; ".join(x for x in (detail, prompts) if x))
            for job, n in parts:
                job.done += n
                job.modeled += modeled or 0.0
            if parts:  # the emulated passes that carried prompt tokens (``Pacer.mixed_time``'s packing)
                prompt = sum(n for _, n in parts) * s.s_in
                self.mixed_passes += -(-prompt // (max(1, self.budget - len(batch)) if batch else self.budget))
                self.mixed_prompt_tokens += prompt
            if batch:
                await self._decoded(batch, results)
            for job in ending:
                if job in self.jobs:
                    self.jobs.remove(job)
                await self._prefilled(job)  # (unless it was, at its pass's end)
            await self.admit_queued()

    async def _prefilled_at(self, job: PrefillJob, due: float) -> None:
        await asyncio.sleep(max(0.0, due - clock.monotonic()))
        await self._prefilled(job)

    async def _prefilled(self, job: PrefillJob) -> None:
        """A prompt's last chunk is done: its KV cached, and the request decodes from the next step."""
        if job.ended or job.dropped:
            return
        job.ended = True
        cmd, tokens = job.cmd, job.cmd.prompt
        try:
            kv, first, real = job.finish(self.cache)
        except Exception as e:  # noqa: BLE001 - the request fails, the worker goes on
            await self.fail(cmd.rid, f"prefill on {self.cfg.name}: {e}")
            return
        new = len(tokens) - job.hit
        self.computed_tokens += new
        self.reused_tokens += job.hit
        now = clock.now()
        self.emit(PrefillDone(**self.stamp(cmd.rid), hit_tokens=job.hit, computed=new, first_token=first,
                              start=job.t0, end=now, real_s=real, modeled_s=None if self.pacer.native else job.modeled))
        seq = self.waiting.pop(cmd.rid, None)
        if seq is None:
            return
        seq.load(kv)
        seq.out = [first]
        seq.kv_arrived = now
        self.emit(KvReceived(**self.stamp(cmd.rid), bytes=0, had=job.hit, start=now, end=now))
        await self._start(seq)
