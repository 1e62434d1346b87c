"""Decode worker: receives KV over TCP, continuous batching, streams tokens to the client.

Continuous batching: every step is *one* batched forward pass over all active requests
(up to ``max_batch``); requests join as soon as their KV has arrived and leave at EOS or
their output length, between steps. Each request's KV lives in a buffer preallocated for
prompt + output, so a step appends in place instead of copying the context; the batch's KV
is kept in one left-padded buffer across steps (``DecodeBatch``): a joining request copies
only its own KV in, a leaving one frees its row; the batch is rebuilt only when it has no
spare row or its headroom is used up.

Admission: a request whose KV has arrived joins the batch only when the decoder has room
(fewer than ``max_batch`` running, and its prompt + output within ``kv_capacity_tokens`` of
KV together with the running and held requests'); otherwise it waits in arrival order, and
its first token is streamed only when it is admitted, so time spent queueing at a full
decoder is part of its TTFT, as it would be on a real one. A request that could never fit
fails at once.

The decode-side radix cache (DRC) keeps prompts' KV so a later request that shares a prefix
needs only the missing part from the network: the receiver states its cached prefix before
any block is sent.

Why not transformers' continuous-batching manager: its paged cache is filled only by its
own prefill; PD disaggregation must inject KV that arrived from the network, and PDD's
handoff must extend a request by several known tokens in one pass. Neither is exposed.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from protocol import clock
from protocol.messages import (
    CancelCmd,
    Command,
    DecodeCmd,
    Done,
    ExtendCmd,
    Failed,
    HandoffAck,
    HandoffCmd,
    KvReceived,
)
from protocol.refusals import refusal
from protocol.worker_config import DecodeCounters, WorkerConfig, WorkerStats
from workers import kv_wire
from workers.allocator import resident_bytes
from workers.expected import Expected
from workers.handoff import HandoffMixin
from workers.modeled import ModeledBatch, ModeledRunner
from workers.radix_cache import RadixCache
from workers.runtime import Worker
from workers.seq import Seq
from workers.transport import HOST, KvServe, Transport

if TYPE_CHECKING:  # transformers: imported only where a model runs (``workers.model_config``)
    from workers.model import DecodeBatch

# Columns a batch can grow by (steps, and joiners longer than its end) before it is rebuilt.
# Unused headroom and spare rows cost no copying (the buffer is not zeroed), only memory that
# stays untouched.
BATCH_HEADROOM = 512


class DecodeWorker(HandoffMixin, Worker):
    PEERS = True  # relays and main decoders send each other the handoff's messages

    def __init__(self, cfg: WorkerConfig, transport: Transport = HOST) -> None:
        super().__init__(cfg, transport)
        # Any cached prefix serves here, a hybrid model's too: the request's state at the
        # prompt's end comes with its transfer; only a prefill restarts from a kept state.
        self.cache: RadixCache = RadixCache(cfg.block_size, cfg.cache_tokens, keeps_kv=cfg.compute != "modeled")
        self.waiting: dict[str, Seq] = {}
        self.running: dict[str, Seq] = {}
        self.held: dict[str, Seq] = {}  # main decoder: KV here, stream still on the relay
        self.admission: dict[str, tuple[Seq, float]] = {}  # KV arrived, no room yet: (seq, since), FIFO
        self.expected = Expected()  # requests whose KV may arrive here
        self.wake = asyncio.Event()
        self.step_log: deque[tuple[int, float]] = deque(maxlen=2000)  # (batch size, real seconds), recent
        self.server: object | None = None  # the KV listener (its transport's)
        self.tokens_out = 0
        self.dbatch: DecodeBatch | ModeledBatch | None = None  # the running batch's KV, kept across steps
        self.dbatch_rows: list[Seq] = []
        self.batch_builds = 0
        self.handoffs_sent = 0
        self.extends_done = 0
        self.extend_mismatches = 0
        self.admission_waits = 0
        self.admission_wait_max_s = 0.0
        self.admission_queue_max = 0

    async def start(self) -> None:
        opts = KvServe(expect=self.runner.shape, token=self.cfg.kv_token, zeros=self._zero_kv(), netns=self.cfg.netns,
                       timeout_s=self.cfg.kv_read_timeout_s, state_bytes=self.cfg.kv_state_bytes)
        self.server = await self.transport.serve_kv(self.cfg.host_ip, self.cfg.kv_port, self._offer, self._arrived,
                                                    self._transfer_failed, opts)
        self.spawn(self._loop())

    def _zero_kv(self) -> Callable[[int], torch.Tensor] | None:
        """Modeled compute: KV of n tokens as a zero view (received KV is checked, not kept)."""
        return self.runner.kv if isinstance(self.runner, ModeledRunner) else None

    def active(self) -> int:
        return len(self.running)

    @property
    def nbytes(self) -> int:
        """KV this worker holds outside its cache, as resident bytes: every sequence's buffer
        (waiting, running, held, admitted) and the running batch's; what its memory floor
        leaves out with the cache (``workers.allocator``)."""
        seqs = {id(s): s for s in (*self.waiting.values(), *self.running.values(), *self.held.values(),
                                   *(s for s, _ in self.admission.values()))}
        bufs = [s.buf for s in seqs.values() if s.buf is not None]
        if self.dbatch is not None and not isinstance(self.dbatch, ModeledBatch):  # a model's: real buffers
            bufs += [t for kv in self.dbatch.bufs for t in kv]
        return sum(resident_bytes(t.data_ptr(), t.nbytes) for t in bufs)

    def queued(self) -> int:
        return len(self.waiting) + len(self.held) + len(self.admission)

    def kv_in_use(self) -> int:
        """KV tokens the admitted requests may grow to (prompt + output each)."""
        return sum(s.prompt_len + s.max_new for s in (*self.running.values(), *self.held.values()))

    def _has_room(self, seq: Seq) -> bool:
        cap = self.cfg.kv_capacity_tokens
        return len(self.running) < self.cfg.max_batch and (
            cap is None or self.kv_in_use() + seq.prompt_len + seq.max_new <= cap)

    async def admit_queued(self) -> None:
        """Admit waiting requests, oldest first, while there is room (called whenever a
        request leaves the batch)."""
        while self.admission:
            rid, (seq, since) = next(iter(self.admission.items()))
            if not self._has_room(seq):
                return
            del self.admission[rid]
            self.admission_wait_max_s = max(self.admission_wait_max_s, clock.now() - since)
            await self._start(seq)

    def activity(self) -> tuple[int, ...]:
        return (*super().activity(), self.tokens_out, self.batch_builds, self.handoffs_sent, self.extends_done,
                self.extend_mismatches, self.admission_waits, self.admission_queue_max)

    def stats(self) -> WorkerStats:
        by_batch: dict[int, list[float]] = {}
        for b, s in self.step_log:
            by_batch.setdefault(b, []).append(s)
        counters = DecodeCounters(
            step_ms_by_batch={b: 1000 * sum(v) / len(v) for b, v in sorted(by_batch.items())},
            tokens_out=self.tokens_out, batch_builds=self.batch_builds, handoffs_sent=self.handoffs_sent,
            extends_done=self.extends_done, extend_mismatches=self.extend_mismatches,
            admission_waits=self.admission_waits, admission_wait_max_s=self.admission_wait_max_s,
            admission_queue_max=self.admission_queue_max,
        )  # fmt: skip
        return super().stats().model_copy(update={"decode": counters})

    # ----------------------------------------------------------------- commands
    async def handle(self, cmd: Command) -> None:
        if isinstance(cmd, DecodeCmd):
            seq = Seq(cmd.rid, cmd.prompt, cmd.max_new, clock.now(), drc=cmd.drc, ignore_eos=cmd.ignore_eos,
                      zeros=self._zero_kv())
            seq.ticket = cmd.ticket
            self.setup_handoff(seq, cmd)
            self.waiting[cmd.rid] = seq
            self.expected.expect(cmd.rid)
            seq.kv_deadline = self.spawn(self._kv_deadline(cmd.rid))
        elif isinstance(cmd, CancelCmd):
            seq = self.waiting.get(cmd.rid)
            if cmd.keep_kv and seq is not None:
                seq.cache_only = True  # the stream ended elsewhere; only cache the KV when it lands
            else:
                await self.drop(cmd.rid)
        elif isinstance(cmd, HandoffCmd):
            await self.on_handoff(cmd)
        elif isinstance(cmd, HandoffAck):
            await self.on_handoff_ack(cmd)
        elif isinstance(cmd, ExtendCmd):
            await self.on_extend(cmd)

    async def _kv_deadline(self, rid: str) -> None:
        """Fails ``rid`` if its KV has not arrived in time. It holds the id, not the sequence,
        and is cancelled when the sequence stops waiting: a timer holding the sequence kept
        every finished request's KV alive for the whole timeout."""
        await asyncio.sleep(self.cfg.kv_timeout_s)
        seq = self.waiting.get(rid)
        if seq is not None and seq.kv_deadline is asyncio.current_task():
            seq.kv_deadline = None  # (not cancelled by the drop below)
            await self.fail(rid, f"KV did not arrive at {self.cfg.name} within {self.cfg.kv_timeout_s} s")

    # ----------------------------------------------------------------- KV receive
    async def _offer(self, rid: str, tokens: list[int], ticket: str) -> int:
        why = await self.expected.wait(rid, self.cfg.kv_hello_wait_s)
        if why is not None:
            raise kv_wire.KVTransferError(f"{rid} is not a request of {self.cfg.name}: {why}")
        seq = self.waiting.get(rid)
        if seq is None:
            raise kv_wire.KVTransferError(f"{rid} is no longer waiting for KV on {self.cfg.name}")
        # The ticket before anything the sender says about the request: a worker of the run that
        # knows the prompt, but was not told to send this KV, is refused and fails nothing.
        if not hmac.compare_digest(ticket.encode(), seq.ticket.encode()):
            refusal(f"{self.cfg.name}: refused KV for {rid}: its HELLO does not carry the request's ticket")
            raise kv_wire.KVRefused(f"the KV offered for {rid} does not carry the ticket {self.cfg.name} was given "
                                    f"for it")
        if len(tokens) != len(seq.prompt) or tokens != list(seq.prompt):  # KV is cached under these tokens
            raise kv_wire.KVTransferError(f"the KV offered for {rid} is of {len(tokens)} tokens that are not its "
                                          f"prompt ({len(seq.prompt)} tokens)")
        if not seq.drc:
            return 0
        path = self.cache.match_prefix(tokens)
        self.cache.lock(path)
        seq.path = path
        return len(path) * self.cfg.block_size

    async def _arrived(self, inc: kv_wire.Incoming) -> None:
        seq = self.waiting.pop(inc.request_id, None)
        if seq is None:
            return
        seq.stop_kv_deadline()
        zeros = self._zero_kv()
        if zeros is not None:  # modeled: the whole prompt's KV is a zero view, nothing to join
            kv = zeros(inc.have + inc.kv.shape[3])
        else:
            cached = self.cache.kv_of(seq.path)
            kv = inc.kv if cached is None else torch.cat([cached, inc.kv], dim=3)
        matched, seq.path = seq.path, []
        self.cache.unlock(matched)
        if seq.drc:
            self.cache.insert(seq.prompt, kv, matched)
        received = KvReceived(**self.stamp(seq.rid), bytes=inc.bytes_received, had=inc.have, start=inc.start,
                              end=inc.end, cache_only=seq.cache_only)
        if seq.cache_only:  # a holder's, or the request ended on a relay: the KV was only wanted for the cache
            self.expected.forget(seq.rid)
            self.emit(received)
            return
        seq.load(kv)
        seq.out = [inc.first_token]
        seq.kv_arrived = clock.now()
        seq.kv_bytes = inc.bytes_received
        self.emit(received)
        if seq.main is not None:  # the relay streams; wait for its eager tokens
            seq.main.pred, seq.out = inc.first_token, []
            self.held[seq.rid] = seq
            return
        cap = self.cfg.kv_capacity_tokens
        if cap is not None and seq.prompt_len + seq.max_new > cap:
            await self.fail(seq.rid, f"{seq.prompt_len + seq.max_new} tokens of KV exceed {self.cfg.name}'s "
                                     f"capacity of {cap}")
            return
        if self.admission or not self._has_room(seq):
            self.admission[seq.rid] = (seq, clock.now())
            self.admission_waits += 1
            self.admission_queue_max = max(self.admission_queue_max, len(self.admission))
            return
        await self._start(seq)

    async def _start(self, seq: Seq) -> None:
        """Admitted: the first token goes out and the request joins the batch."""
        if seq.relay is not None and seq.relay.eager_budget == 0:
            seq.paused = True  # hand over before streaming anything
        else:
            self.stream(seq.rid, 0, [seq.out[0]], done=self.finished(seq))
            seq.streamed = 1
            if self.finished(seq):
                self.complete(seq)
                return
        self.running[seq.rid] = seq
        self.wake.set()
        if seq.relay is not None:
            await self.maybe_hand_off(seq)

    async def _transfer_failed(self, rid: str, msg: str) -> None:
        if rid in self.waiting:
            await self.fail(rid, msg)

    # ----------------------------------------------------------------- decode loop
    def finished(self, seq: Seq) -> bool:
        return len(seq.out) >= seq.max_new or (not seq.ignore_eos and seq.out[-1] == self.runner.eos_token_id)

    async def _loop(self) -> None:
        while True:
            batch = self._decodable()
            if not batch:
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.device:
                # Those still running once the device is free (a handoff's extend may have held it);
                # requests that joined meanwhile wait for the next step.
                batch = [s for s in batch if self.running.get(s.rid) is s and not s.paused]
                if not batch:
                    continue
                results, real, detail = await self._decode_step(batch)
                modeled = None if self.pacer.native else self.pacer.decode_time([s.n for s in batch])
                await self.pace("decode", real, modeled, detail)
            await self._decoded(batch, results)
            await self.admit_queued()

    def _decodable(self) -> list[Seq]:
        """The requests the next step decodes: running, not paused, at most ``max_batch``."""
        return [s for s in self.running.values() if not s.paused][: self.cfg.max_batch]

    async def _decode_step(self, batch: list[Seq]) -> tuple[list[tuple[torch.Tensor, int]], float, str]:
        """One batched forward pass over ``batch`` (the caller holds the device): each row's
        new KV and token, the real seconds (forming the batch included), what to log."""
        builds = self.batch_builds
        (self.dbatch, rows), build = await self.run_compute(self._form_batch, batch)
        batch[:] = rows  # row order
        results, real = await self.run_compute(self.dbatch.step, [s.out[-1] for s in batch])
        self.step_log.append((len(batch), real))
        detail = (f"batch {len(batch)}, step {1000 * real:.0f} ms, forming the batch {1000 * build:.0f} ms"
                  + (" (rebuilt)" if self.batch_builds > builds else ""))
        return results, real + build, detail

    async def _decoded(self, batch: list[Seq], results: list[tuple[torch.Tensor, int]]) -> None:
        """A step's tokens: appended, streamed; finished requests complete, relays hand over."""
        for seq, (new_kv, tok) in zip(batch, results, strict=True):
            if self.running.get(seq.rid) is not seq:
                continue  # cancelled while the step ran
            seq.append(new_kv, [tok])
            done = self.finished(seq)
            self.stream(seq.rid, len(seq.out) - 1, [tok], done=done)
            seq.streamed += 1
            self.tokens_out += 1
            if self.tokens_out == self.cfg.faults.die_after_tokens:
                os._exit(9)  # fault injection (tests): die abruptly, like kill -9
            if done:
                del self.running[seq.rid]
                self.complete(seq)
            elif seq.relay is not None:
                await self.maybe_hand_off(seq)

    def _form_batch(self, wanted: list[Seq]) -> tuple[DecodeBatch | ModeledBatch, list[Seq]]:
        """The decode batch for ``wanted`` and its members in row order (compute thread).

        Leavers (and rows whose request's KV changed outside the batch) are removed and
        joiners added one row at a time; the batch is rebuilt, with spare rows, only when
        there is no spare row or the headroom is used up."""
        rows, b = self.dbatch_rows, self.dbatch
        if b is not None and not b.full:
            keep = set(wanted)
            for r in reversed(range(len(rows))):
                if rows[r] not in keep or b.lens[r] != rows[r].n:
                    b.remove(r)
                    rows[r] = rows[-1]
                    rows.pop()
            present = set(rows)
            joining = [s for s in wanted if s not in present]
            for seq in joining:
                if not b.fits(seq.kv):
                    break
                b.add(seq.kv)
                rows.append(seq)
            else:
                return b, list(rows)
        self.batch_builds += 1
        # Sized once for the worker's whole batch and twice the longest context, so later
        # rebuilds reuse it: fresh memory costs a page fault per 4 KB as rows are copied in
        # (~0.9 s for 20 requests of 3.7K tokens under load here).
        spare = max(4, self.cfg.max_batch - len(wanted))
        end = max(s.n for s in wanted)
        old = None if isinstance(self.dbatch, ModeledBatch) else self.dbatch
        self.dbatch = self.runner.batch([s.kv for s in wanted], headroom=max(BATCH_HEADROOM, end), spare=spare,
                                        reuse=old)
        self.dbatch_rows = list(wanted)
        return self.dbatch, list(wanted)

    def complete(self, seq: Seq) -> None:
        self.expected.forget(seq.rid)
        relayed = seq.relay is not None  # finished here, on the relay: no handoff
        self.emit(Done(**self.stamp(seq.rid), output_tokens=len(seq.out), kv_bytes=seq.kv_bytes,
                       handed_off=False if relayed else None, eager=seq.streamed if relayed else None,
                       taken_over_at=seq.main.extended if seq.main is not None else None))

    async def drop(self, rid: str) -> Seq | None:
        seq = (self.waiting.pop(rid, None) or self.running.pop(rid, None) or self.held.pop(rid, None)
               or self.admission.pop(rid, (None, 0.0))[0])
        if seq is not None:
            seq.stop_kv_deadline()
        self.expected.forget(rid)
        if seq is not None and seq.path:
            self.cache.unlock(seq.path)
            seq.path = []
        self.spawn(self.admit_queued())  # room may have been freed
        return seq

    async def fail(self, rid: str, reason: str) -> None:
        seq = await self.drop(rid)
        if seq is not None and seq.main is not None and not seq.main.final:
            # The client's stream is on the relay: report, do not end the stream here.
            self.emit(Failed(**self.stamp(rid), reason=reason, before_handoff=True))
            return
        self.stream(rid, 0, [], done=True, error=reason)
        self.emit(Failed(**self.stamp(rid), reason=reason))
