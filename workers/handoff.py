"""PDD's extend-decode handoff between a relay decoder (RLD) and a main decoder (MD).

Both sides are ordinary decode workers; a request's decode command says which side this
worker plays for it (``options.relay_for`` = the MD it hands over to; ``options.held`` =
wait for a relay's tokens).

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

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.control import Command

if TYPE_CHECKING:
    from workers.decode import DecodeWorker, Seq

MAX_CATCH_UP_ROUNDS = 16  # after this many batches the rest goes in one final batch


@dataclass
class RelayState:
    main: str  # the MD worker to hand over to
    eager_budget: int | None = None
    ready: dict[str, Any] | None = None  # handoff options once the MD holds the KV
    handed: int = 0  # eager tokens handed over so far
    awaiting_ack: bool = False
    batches: list[int] = field(default_factory=list)
    last_pending: int | None = None  # pending tokens when the last catch-up batch was sent


@dataclass
class MainState:
    relay: str  # the RLD that streams until the handoff
    pred: int = 0  # greedy token after everything extended so far
    extended: int = 0
    final: bool = False
    mismatches: int = 0


class HandoffMixin:
    """Relay and main-decoder behaviour of ``DecodeWorker`` (see the module docstring)."""

    handoffs_sent = 0
    extends_done = 0
    extend_mismatches = 0

    def setup_handoff(self: DecodeWorker, seq: Seq, options: dict[str, Any]) -> None:
        if options.get("relay_for"):
            seq.relay = RelayState(options["relay_for"], options.get("eager_budget"))
        elif options.get("held"):
            seq.main = MainState(options["relay"])

    def handoff_info(self) -> dict[str, Any]:
        return {"handoffs_sent": self.handoffs_sent, "extends_done": self.extends_done,
                "extend_mismatches": self.extend_mismatches}

    # ----------------------------------------------------------------- relay side
    async def on_handoff(self: DecodeWorker, cmd: Command) -> None:
        if "ack" in cmd.options:  # the MD extended a catch-up batch
            seq = self.running.get(cmd.rid)
            if seq is not None and seq.relay is not None:
                seq.relay.awaiting_ack = False
                await self.maybe_hand_off(seq)
            return
        waiting = self.waiting.get(cmd.rid)
        if waiting is not None and waiting.relay is not None:
            # The MD holds the KV before this relay did: hand over with no eager token.
            if cmd.options.get("mode") != "local":
                await self._drop(cmd.rid)
                await self._send_extend(waiting, [], final=True)
                await self.event("done", cmd.rid, handed_off=True, eager=0, batches=[0], output_tokens=0)
            else:
                waiting.relay = None
            return
        seq = self.running.get(cmd.rid)
        if seq is None or seq.relay is None:
            return  # already finished here, or cancelled
        seq.relay.ready = dict(cmd.options)
        await self.maybe_hand_off(seq)

    async def maybe_hand_off(self: DecodeWorker, seq: Seq) -> None:
        rs = seq.relay
        if rs is None or self.running.get(seq.rid) is not seq:
            return
        if rs.eager_budget is not None and seq.streamed < rs.eager_budget:
            return
        if rs.ready is None:
            if rs.eager_budget is not None:
                seq.paused = True  # hold at exactly the budget until the MD is ready
            return
        if rs.ready.get("mode") == "local":
            seq.relay, seq.paused = None, False  # finish here as an ordinary decode
            self.wake.set()
            return
        seq.paused = False
        self.wake.set()
        if rs.awaiting_ack:
            return
        pending = seq.out[rs.handed : seq.streamed]
        batch = max(1, int(rs.ready.get("batch", 64)))
        one_shot = rs.ready.get("mode", "one-shot") == "one-shot"
        stalled = rs.last_pending is not None and len(pending) >= rs.last_pending
        if one_shot or len(pending) <= batch or stalled or len(rs.batches) >= MAX_CATCH_UP_ROUNDS:
            del self.running[seq.rid]
            await self._send_extend(seq, pending, final=True)
            self.registered.pop(seq.rid, None)
            await self.event("done", seq.rid, handed_off=True, eager=seq.streamed, batches=rs.batches,
                             output_tokens=seq.streamed)
        else:
            rs.awaiting_ack = True
            rs.last_pending = len(pending)
            await self._send_extend(seq, pending[:batch], final=False)

    async def _send_extend(self: DecodeWorker, seq: Seq, tokens: list[int], final: bool) -> None:
        rs = seq.relay
        assert rs is not None
        cmd = Command(op="extend", rid=seq.rid, tokens=tokens, options={"start": rs.handed, "final": final})
        rs.handed += len(tokens)
        rs.batches.append(len(tokens))
        self.handoffs_sent += 1
        # Spawned like the token publishes before it, so the broker gets them in order.
        self.spawn(self.publish(self.topics.cmd(rs.main), cmd.dump()))
        await self.event("handoff", seq.rid, tokens=len(tokens), start=rs.handed - len(tokens), final=final,
                         to=rs.main)

    # ----------------------------------------------------------------- main side
    async def on_extend(self: DecodeWorker, cmd: Command) -> None:
        seq = self.held.get(cmd.rid)
        if seq is None or seq.main is None:
            return  # cancelled (the relay finished alone) or never ours
        ms = seq.main
        start, final, toks = int(cmd.options.get("start", 0)), bool(cmd.options.get("final")), cmd.tokens
        if start != ms.extended:
            await self._fail(cmd.rid, f"handoff out of order on {self.cfg.name}: got start {start}, "
                                      f"expected {ms.extended}")
            return
        t0 = time.time()
        real = 0.0
        if toks:
            (new_kv, preds), real = await self.run_compute(self.runner.extend, seq.kv, toks)
            modeled = None if self.pacer.native else self.pacer.decode_time(self.cost, [seq.n], len(toks))
            await self.pace("extend", real, modeled)
            if self.held.get(cmd.rid) is not seq:
                return  # cancelled while extending
            wrong = int(toks[0] != ms.pred) + sum(int(p != t) for p, t in zip(preds[:-1], toks[1:], strict=True))
            ms.mismatches += wrong
            self.extend_mismatches += wrong
            assert seq.buf is not None
            seq.buf[:, :, :, seq.n : seq.n + len(toks)] = new_kv
            seq.n += len(toks)
            seq.out.extend(toks)
            ms.pred = preds[-1]
            ms.extended += len(toks)
        self.extends_done += 1
        await self.event("extended", cmd.rid, tokens=len(toks), start=start, final=final, mismatches=ms.mismatches,
                         compute_s=real, t_start=t0, since_kv_s=time.time() - seq.kv_arrived)
        if not final:
            ack = Command(op="handoff", rid=cmd.rid, options={"ack": ms.extended})
            await self.publish(self.topics.cmd(ms.relay), ack.dump())
            return
        ms.final = True
        del self.held[cmd.rid]
        seq.out.append(ms.pred)
        done = self._finished(seq)
        await self.stream(seq.rid, len(seq.out) - 1, [ms.pred], done=done)
        seq.streamed += 1
        self.tokens_out += 1
        if done:
            await self._complete(seq)
        else:
            self.running[seq.rid] = seq
            self.wake.set()
