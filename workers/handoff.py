"""PDD's extend-decode handoff between a relay decoder (RLD) and a main decoder (MD).

Both sides are ordinary decode workers; a request's ``DecodeCmd`` says which side this
worker plays for it (``relay``: the MD it hands over to; ``main``: the RLD whose tokens it
waits for). The messages are ``HandoffCmd`` / ``HandoffAck`` / ``ExtendCmd`` in
``protocol/messages.py``.

Guarantees (greedy decoding):

* The client sees one ordered stream. The RLD streams output indices ``0 .. k-1`` (the
  *eager* tokens) and stops; the MD streams from index ``k`` on. The RLD publishes its last
  token before the final ``extend``, and the MD can only stream after that ``extend``
  reached it, so no index is duplicated, missing or reordered.
* Only token IDs cross the WAN for the handoff, never their KV: the MD recomputes the KV of
  the eager tokens in one batched forward pass (``ModelRunner.extend``) on top of the
  prompt KV it received, checks each prediction against the token the RLD produced
  (mismatches are counted; in float64 there are none), and continues decoding.
* Modes (chosen per request when the MD holds the KV; see the PDD policy):
  ``one-shot``: all eager tokens at once; the RLD stops at once.
  ``catch-up``: batches of at most ``batch`` tokens; the RLD keeps decoding while the MD
  extends, each batch acknowledged, until what is left fits in one batch (then final).
  If a round does not shrink what is pending (the RLD produces tokens as fast as a round
  trip hands them over), the rest goes in one final batch, so a handoff always ends.
  ``local``: the MD cannot take over (its transfer failed): the RLD finishes alone.
* ``eager_budget`` K (optional): the RLD starts the handoff exactly after K eager tokens,
  holding (not decoding) at K until the MD is ready. K = 0 hands over before any token is
  streamed. A request that ends on the RLD before the handoff simply completes there
  (the router then cuts off the MD's transfer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import torch

from protocol import clock
from protocol.messages import (
    Command,
    DecodeCmd,
    Done,
    Event,
    ExtendCmd,
    Extended,
    HandoffAck,
    HandoffCmd,
    HandoffSent,
)
from protocol.topics import Topics
from protocol.worker_config import WorkerConfig
from workers.device import Pacer
from workers.expected import Expected
from workers.seq import MainState, RelayState, Seq

if TYPE_CHECKING:  # transformers: imported only where a model runs (``workers.model_config``)
    from workers.model import ModelRunner

MAX_CATCH_UP_ROUNDS = 16  # after this many batches the rest goes in one final batch


class DecodeSide(Protocol):
    """What the handoff needs from the decode worker it is mixed into."""

    cfg: WorkerConfig
    topics: Topics
    runner: ModelRunner
    pacer: Pacer
    device: asyncio.Lock
    waiting: dict[str, Seq]
    running: dict[str, Seq]
    held: dict[str, Seq]
    expected: Expected
    wake: asyncio.Event
    tokens_out: int
    handoffs_sent: int
    extends_done: int
    extend_mismatches: int

    def stamp(self, rid: str) -> dict[str, Any]: ...
    def emit(self, event: Event) -> None: ...
    def send(self, topic: str, payload: bytes) -> None: ...
    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None: ...
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...
    async def run_compute(self, fn: Any, *args: Any) -> tuple[Any, float]: ...
    async def pace(self, kind: str, real_s: float, modeled_s: float | None) -> None: ...
    def stream(self, rid: str, start: int, tokens: list[int], done: bool = False,
               error: str | None = None) -> None: ...
    def complete(self, seq: Seq) -> None: ...
    async def drop(self, rid: str) -> Seq | None: ...
    async def admit_queued(self) -> None: ...
    async def fail(self, rid: str, reason: str) -> None: ...
    def finished(self, seq: Seq) -> bool: ...
    async def maybe_hand_off(self, seq: Seq) -> None: ...
    async def _send_extend(self, seq: Seq, tokens: list[int], final: bool) -> None: ...


class HandoffMixin:
    """Relay and main-decoder behaviour of ``DecodeWorker`` (see the module docstring)."""

    @staticmethod
    def setup_handoff(seq: Seq, cmd: DecodeCmd) -> None:
        if cmd.relay is not None:
            seq.relay = RelayState(cmd.relay.main, cmd.relay.eager_budget)
        elif cmd.main is not None:
            seq.main = MainState(cmd.main.relay)

    def peer_refusal(self: DecodeSide, sender: str, cmd: Command) -> str | None:
        """Why a command decoder ``sender`` sent (on its own topic to this one) is refused;
        None: taken. A peer sends only the handoff's two messages, for a request whose command
        named it as this decoder's partner: an extend from its relay, an ack from its main
        decoder (one the request no longer has state for is ignored where it is handled)."""
        if isinstance(cmd, ExtendCmd):
            seq = self.held.get(cmd.rid) or self.waiting.get(cmd.rid) or self.running.get(cmd.rid)
            partner = seq.main.relay if seq is not None and seq.main is not None else None
        elif isinstance(cmd, HandoffAck):
            seq = self.running.get(cmd.rid) or self.waiting.get(cmd.rid)
            partner = seq.relay.main if seq is not None and seq.relay is not None else None
        else:
            return f"a peer decoder sends only extend and handoff_ack, not {cmd.op}"
        if partner is not None and partner != sender:
            return f"{sender} is not the partner of {cmd.rid} here ({partner} is)"
        return None

    # ----------------------------------------------------------------- relay side
    async def on_handoff_ack(self: DecodeSide, cmd: HandoffAck) -> None:
        """The MD extended a catch-up batch: send the next one."""
        seq = self.running.get(cmd.rid)
        if seq is not None and seq.relay is not None and seq.relay.awaiting_ack and cmd.extended == seq.relay.handed:
            seq.relay.awaiting_ack = False  # (a repeated ack, for an earlier batch, is ignored)
            await self.maybe_hand_off(seq)

    async def on_handoff(self: DecodeSide, cmd: HandoffCmd) -> None:
        waiting = self.waiting.get(cmd.rid)
        if waiting is not None and waiting.relay is not None:
            # The MD holds the KV before this relay did: hand over with no eager token.
            if cmd.mode != "local":
                await self.drop(cmd.rid)
                await self._send_extend(waiting, [], final=True)
                self.emit(Done(**self.stamp(cmd.rid), handed_off=True, eager=0, batches=[0], output_tokens=0))
            else:
                waiting.relay = None
            return
        seq = self.running.get(cmd.rid)
        if seq is None or seq.relay is None:
            return  # already finished here, or cancelled
        seq.relay.ready = cmd
        await self.maybe_hand_off(seq)

    async def maybe_hand_off(self: DecodeSide, seq: Seq) -> None:
        rs = seq.relay
        if rs is None or self.running.get(seq.rid) is not seq:
            return
        if rs.eager_budget is not None and seq.streamed < rs.eager_budget:
            return
        if rs.ready is None:
            if rs.eager_budget is not None:
                seq.paused = True  # hold at exactly the budget until the MD is ready
            return
        if rs.ready.mode == "local":
            seq.relay, seq.paused = None, False  # finish here as an ordinary decode
            self.wake.set()
            return
        seq.paused = False
        self.wake.set()
        if rs.awaiting_ack:
            return
        pending = seq.out[rs.handed : seq.streamed]
        batch = rs.ready.batch
        one_shot = rs.ready.mode == "one-shot"
        stalled = rs.last_pending is not None and len(pending) >= rs.last_pending
        if one_shot or len(pending) <= batch or stalled or len(rs.batches) >= MAX_CATCH_UP_ROUNDS:
            del self.running[seq.rid]
            self.spawn(self.admit_queued())  # the relay's row is free
            await self._send_extend(seq, pending, final=True)
            self.expected.forget(seq.rid)
            self.emit(Done(**self.stamp(seq.rid), handed_off=True, eager=seq.streamed, batches=rs.batches,
                           output_tokens=seq.streamed))
        else:
            rs.awaiting_ack = True
            rs.last_pending = len(pending)
            await self._send_extend(seq, pending[:batch], final=False)

    async def _send_extend(self: DecodeSide, seq: Seq, tokens: list[int], final: bool) -> None:
        rs = seq.relay
        assert rs is not None
        cmd = ExtendCmd(rid=seq.rid, tokens=tokens, start=rs.handed, final=final)
        rs.handed += len(tokens)
        rs.batches.append(len(tokens))
        self.handoffs_sent += 1
        # After the tokens buffered before it (``send``), so the broker gets them in order.
        self.send(self.topics.peer(rs.main, self.cfg.name), cmd.dump())
        self.emit(HandoffSent(**self.stamp(seq.rid), tokens=len(tokens), start=rs.handed - len(tokens),
                              final=final, to=rs.main))

    # ----------------------------------------------------------------- main side
    async def on_extend(self: DecodeSide, cmd: ExtendCmd) -> None:
        seq = self.held.get(cmd.rid)
        if seq is None or seq.main is None:
            return  # cancelled (the relay finished alone) or never ours
        ms = seq.main
        toks = cmd.tokens
        if cmd.start < ms.claimed or (cmd.start == ms.claimed and ms.final_claimed):
            return  # a repeat (QoS 1 after a broker restart) of an extend taken already
        if cmd.start != ms.claimed:
            await self.fail(cmd.rid, f"handoff out of order on {self.cfg.name}: got start {cmd.start}, "
                                     f"expected {ms.claimed}")
            return
        # Claimed before the first await: a repeat delivered while this extend computes
        # must not extend the same tokens twice.
        ms.claimed += len(toks)
        ms.final_claimed = cmd.final
        t0 = clock.now()
        real = 0.0
        if toks:
            async with self.device:
                (new_kv, preds), real = await self.run_compute(self.runner.extend, seq.kv, toks)
                modeled = None if self.pacer.native else self.pacer.extend_time(seq.n, len(toks))
                await self.pace("extend", real, modeled)
            if self.held.get(cmd.rid) is not seq:
                return  # cancelled while extending
            wrong = int(toks[0] != ms.pred) + sum(int(p != t) for p, t in zip(preds[:-1], toks[1:], strict=True))
            ms.mismatches += wrong
            self.extend_mismatches += wrong
            assert isinstance(new_kv, torch.Tensor)
            seq.append(new_kv, toks)
            ms.pred = preds[-1]
            ms.extended += len(toks)
        self.extends_done += 1
        self.emit(Extended(**self.stamp(cmd.rid), tokens=len(toks), start=cmd.start, final=cmd.final,
                           mismatches=ms.mismatches, compute_s=real, t_start=t0,
                           since_kv_s=clock.now() - seq.kv_arrived))
        if not cmd.final:
            # Spawned, not awaited: the ack crosses the WAN and must not hold this worker up.
            self.send(self.topics.peer(ms.relay, self.cfg.name), HandoffAck(rid=cmd.rid, extended=ms.extended).dump())
            return
        ms.final = True
        del self.held[cmd.rid]
        seq.out.append(ms.pred)
        done = self.finished(seq)
        self.stream(seq.rid, len(seq.out) - 1, [ms.pred], done=done)
        seq.streamed += 1
        self.tokens_out += 1
        if done:
            self.complete(seq)
        else:
            self.running[seq.rid] = seq
            self.wake.set()
