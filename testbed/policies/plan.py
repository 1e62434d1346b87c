"""A request's pipeline as data: which workers serve it and in what role, when one takes over
from another, and what losing each means. Policies build it; one router interprets it for
every policy (``control/rules.py``, ``control/router.py``), so a design is a use of this
vocabulary, not code in the router (``docs/policies.md``, "The plan").

Roles:

* ``prefill`` computes the prompt's KV and sends it to every receiver below (after the prefill
  or streamed as it is computed: ``kv_transfer``).
* ``decode``, the *main* decoder, streams the request's tokens to its end; with a lead, from
  the handoff on.
* ``relay``, the *lead* (optional), streams first (eager tokens) and hands the stream over by
  token ids once the main decoder holds the KV (the policy's ``handoff`` says how: one shot
  or in batches); if it finishes first, the policy's ``cut_off`` says whether the main
  decoder's transfer is cut off or lands in its cache. PDD's relay decoder (P-RLD-MD).
* ``hold``: decoders that take the KV into their prefix cache only and never stream (a
  remote cache tier, a standby warmed for a session's next turn). Losing one, or its
  transfer failing, never fails the request.

* one worker named as both ``prefill`` and ``decode`` prefills and decodes the request itself
  (a colocated instance, ``workers/colocated.py``): its KV never leaves it.

Loss rule: ``if_main_lost`` says what the main decoder's loss before the handoff means when
a lead streams: ``lead-alone`` (the lead finishes the request; PDD) or ``fail``. Otherwise a
request fails when a worker it still needs is lost, and not when it no longer needs it (a
prefill whose KV every streamer holds, a lead that handed over, any holder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.policy import PlanInfo
from protocol.worker_config import KvTransfer

Role = Literal["prefill", "lead", "main", "hold"]


@dataclass(frozen=True)
class Plan:
    """Which workers serve a request, and in what role (the module's docstring)."""

    pipeline: str  # label recorded with the request, e.g. "P-D(a)", "P-MD", "P-RLD-MD"
    prefill: str
    decode: str  # the main decoder
    relay: str | None = None  # the lead: streams first, hands over to ``decode``
    info: PlanInfo = field(default_factory=PlanInfo, compare=False)  # why (recorded)
    kv_transfer: KvTransfer | None = None  # when the prefill's KV leaves (None: the scenario's kv_transfer)
    kv_connections: int | None = None  # TCP connections per transfer (None: the scenario's kv_connections)
    hold: tuple[str, ...] = ()  # decoders that take the KV into their caches only
    if_main_lost: Literal["lead-alone", "fail"] = "lead-alone"  # the main decoder lost before the handoff

    def __post_init__(self) -> None:
        # A plan the router could not carry out is the policy's bug: said here, where it was built
        # (the router fails that request with this reason, ``control/decisions.py``).
        # One worker may prefill and decode a request (``colocated``), nothing else twice.
        named = [self.prefill, *([self.decode] if self.decode != self.prefill else []),
                 *([self.relay] if self.relay else []), *self.hold]
        twice = sorted({w for w in named if named.count(w) > 1})
        if twice:
            raise ValueError(f"plan {self.pipeline}: {', '.join(twice)} named in two roles (one worker, one role)")
        if not isinstance(self.hold, tuple):
            object.__setattr__(self, "hold", tuple(self.hold))

    @property
    def streamers(self) -> tuple[str, ...]:
        """The workers that stream the request's tokens, the first to stream first."""
        return (self.relay, self.decode) if self.relay else (self.decode,)

    @property
    def receivers(self) -> tuple[str, ...]:
        """The workers the prefill sends the KV to, in the order they are told."""
        return (*self.streamers, *self.hold)

    @property
    def workers(self) -> set[str]:
        return {self.prefill, *self.receivers}

    @property
    def colocated(self) -> bool:
        """One worker prefills and decodes."""
        return self.prefill == self.decode

    def role_of(self, worker: str) -> Role | None:
        if worker == self.prefill:
            return "prefill"
        if worker == self.decode:
            return "main"
        if worker == self.relay:
            return "lead"
        return "hold" if worker in self.hold else None
