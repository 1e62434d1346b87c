"""The policy interface and the request state it reads.

A policy is a class behind one interface, registered by name (``registry.py``; a user's
policy is one file of its own, ``docs/policies.md``): its ``name``, its typed ``Options``
(defaults and ranges, which ``testbed tune`` searches), the roles it ``deploys``, and its
decisions: ``plan`` a request over the cluster's live view; say what each decoder is told
(``decode_command``) and how a relay hands over (``handoff``); decide whether a useless WAN
transfer is cut off (``cut_off``); react to worker events (``on_event``, ``on_end``). It
returns typed commands from ``protocol/messages.py``, so the options a worker understands
are stated once, there.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.messages import DecodeCmd, Event, HandoffCmd, PrefillDone, RequestHints
from protocol.policy import Candidate, PolicyContext, PolicyReport, spell
from protocol.worker_config import MAX_KV_CONNECTIONS, STREAMED, KvTransfer
from testbed.policies.plan import Plan
from testbed.policies.prefix_index import PrefixIndex
from testbed.policies.token_ids import token_array


@dataclass
class WorkerView:
    name: str
    role: str
    dc: str
    host: str
    kv_port: int
    up: bool = False
    active: int = 0
    queued: int = 0
    assigned: int = 0  # requests the router has in flight on this worker (fresher than status)
    tflops: float | None = None  # the compute a prefill gets on it (``WorkerEndpoint.prefill_tflops``)


AFFINITY_SLACK = 4  # requests more than the least-loaded worker that a prefix match may cost


def busy(w: WorkerView) -> tuple[int, int]:
    """Requests in flight on a worker: the router's count (fresher), then the worker's own."""
    return (w.assigned, w.active + w.queued)


def _load(w: WorkerView) -> tuple[int, int, str]:
    return (*busy(w), w.name)


@dataclass
class ClusterView:
    """What the router knows about the workers right now (from their status messages), and
    what each worker's prefix cache probably holds (prompts the router sent it)."""

    workers: dict[str, WorkerView] = field(default_factory=dict)
    block_size: int = 16
    cache_tokens: int = 262144
    held: dict[str, PrefixIndex] = field(default_factory=dict)
    exact_roles: frozenset[str] = frozenset()  # roles whose caches resume only at kept states (a hybrid's prefill)
    # While the router traces decisions: every worker a decision weighed, as it weighed it
    # (``pick`` adds its candidates; a policy adds its own with ``weigh``); None: not traced.
    weighed: list[Candidate] | None = None

    def weigh(self, worker: str, score: float | None = None, note: str = "") -> None:
        """Record that the decision under way weighed ``worker`` (``--trace-decisions``)."""
        if self.weighed is not None:
            self.weighed.append(Candidate(worker=worker, score=score, note=note))

    def pick(self, role: str, dc: str | None = None, prompt: Sequence[int] | None = None) -> WorkerView:
        """A live worker of a role (optionally in one datacenter): the least loaded; given a
        prompt, the one expected to hold the longest prefix of it (prefix-cache affinity),
        unless that one has more than ``AFFINITY_SLACK`` requests beyond the least loaded."""
        cands = [w for w in self.workers.values() if w.role == role and w.up and (dc is None or w.dc == dc)]
        if not cands:
            where = f" in datacenter {dc}" if dc else ""
            raise LookupError(f"no live {role} worker{where}")
        least = min(cands, key=_load)
        if prompt is None or len(cands) == 1:
            chosen, have = least, {}
        else:
            have = {w.name: self._index(w.name).match(prompt) for w in cands}
            best = min(cands, key=lambda w: (-have[w.name], *_load(w)))
            chosen = least if have[best.name] == 0 or best.assigned - least.assigned > AFFINITY_SLACK else best
        if self.weighed is not None:
            for w in cands:
                cached = f", prefix {have[w.name]} tokens" if w.name in have else ""
                self.weigh(w.name, float(w.assigned), f"{role}: {w.assigned} assigned{cached}"
                           + (" (chosen)" if w is chosen else ""))
        return chosen

    def pick_outside(self, role: str, dc: str, prompt: Sequence[int] | None = None) -> WorkerView:
        """As ``pick``, in the first other datacenter that has a live worker of the role."""
        remote = sorted({w.dc for w in self.workers.values() if w.role == role and w.dc != dc and w.up})
        if not remote:
            raise LookupError(f"no live {role} worker outside datacenter {dc}")
        return self.pick(role, dc=remote[0], prompt=prompt)

    def remember(self, worker: str, prompt: Sequence[int]) -> None:
        """``worker`` was given ``prompt``: its prefix cache will hold it (affinity hint). A
        role with one instance has no choice to make: nothing is hashed for it."""
        role = self.workers[worker].role
        if sum(w.role == role for w in self.workers.values()) > 1:
            self._index(worker).insert(prompt)

    def _index(self, worker: str) -> PrefixIndex:
        if worker not in self.held:
            exact = self.workers[worker].role in self.exact_roles
            self.held[worker] = PrefixIndex(self.block_size, self.cache_tokens, exact_states=exact)
        return self.held[worker]


@dataclass
class RequestState:
    """A request in the router, from admission to its end."""

    rid: str
    prompt: array[int]  # any sequence of ids given; held as ``token_array``
    max_new: int
    arrived: float  # the router's monotonic clock (deadlines; a wall clock step moves none)
    hints: RequestHints = field(default_factory=RequestHints)  # held without ``answer``
    plan: Plan | None = None
    events: list[Event] = field(default_factory=list)
    handed_off: bool = False  # a relay handed the stream to the main decoder
    md_failed: str | None = None  # the main decoder failed; the relay finishes alone
    cut_off: bool = False  # the WAN transfer to the main decoder was cut off
    answer: array[int] = field(init=False)  # ``hints.answer``: the tokens the session's next turn carries
    nbytes: int = field(init=False, default=0)  # what its token arrays take in memory (the router's floor)

    def __post_init__(self) -> None:
        self.prompt = token_array(self.prompt)
        self.answer = token_array(self.hints.answer or ())
        if self.hints.answer is not None:
            self.hints = self.hints.model_copy(update={"answer": None})
        self.nbytes = sys.getsizeof(self.prompt) + sys.getsizeof(self.answer)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def prefill_done(self) -> PrefillDone | None:
        return next((e for e in self.events if isinstance(e, PrefillDone)), None)


class NoOptions(BaseModel):
    """The options of a policy that has none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def transfer_option() -> Any:
    """A policy's ``transfer`` option: when its KV leaves the prefill (``per-chunk`` or
    ``per-layer``: streamed as it is computed, ``after-prefill``); unset, the scenario's
    ``workers.kv_transfer``."""
    return Field(default=None, description="when the KV leaves the prefill", json_schema_extra={"tune": False})


def connections_option() -> Any:
    """A policy's ``connections`` option: how many TCP connections each of its KV transfers
    uses at most (frames spread over them in turn); unset, the scenario's ``workers.kv_connections``."""
    return Field(default=None, ge=1, le=MAX_KV_CONNECTIONS, description="TCP connections per KV transfer",
                 json_schema_extra={"tune": False})


class TransferOptions(BaseModel):
    """The options of a policy whose only options say how its KV travels (``transfer_option``,
    ``connections_option``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transfer: KvTransfer | None = transfer_option()
    connections: int | None = connections_option()


class Policy(ABC):
    name: ClassVar[str] = "policy"
    # The policy's options: a pydantic model with a default for each (``extra="forbid"``);
    # numbers with both bounds (``ge``/``le``) and literals are what ``testbed tune`` searches
    # (``json_schema_extra={"tune": False}`` leaves one out, ``{"tune": {"low": .., "high": ..,
    # "log": True}}`` narrows a range).
    Options: ClassVar[type[BaseModel]] = NoOptions
    ctx: PolicyContext = PolicyContext()
    # What the policy deploys (its hardware cost, ``testbed/analysis/cost.py``): (role, where) pairs,
    # "home" = the datacenter requests enter (``PolicyContext.home_dc``), "away" = the other; and whether
    # it needs the inter-datacenter line.
    deploys: ClassVar[tuple[tuple[str, Literal["home", "away"]], ...]] = ()
    crosses_wan: ClassVar[bool] = False
    # Of ``deploys``, what the policy cannot plan without (a scenario lacking one is refused at start).
    needs: ClassVar[tuple[tuple[str, Literal["home", "away"]], ...]] = ()

    def __init__(self, options: BaseModel | None = None) -> None:
        self.opts = options if options is not None else self.Options()

    def bind(self, ctx: PolicyContext) -> None:
        """Called once by the router before the first request."""
        self.ctx = ctx

    @abstractmethod
    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        """Choose workers for a new request. Raise LookupError if none can serve it."""

    def streamed(self, plan: Plan) -> bool:
        """Whether ``plan``'s KV leaves as it is computed: its transfer then takes the
        prefill's time, not only the line's (no sample of the line's rate)."""
        return (plan.kv_transfer or self.ctx.kv_transfer) in STREAMED

    def decode_command(self, req: RequestState, plan: Plan, worker: str) -> DecodeCmd:
        """The decode command sent to ``worker`` (default: decode the request to its end)."""
        return DecodeCmd(rid=req.rid, prompt=req.prompt.tolist(), max_new=req.max_new)

    def handoff(self, req: RequestState, cluster: ClusterView) -> HandoffCmd:
        """How the relay hands over once the main decoder holds the KV (relay plans only)."""
        return HandoffCmd(rid=req.rid, mode="one-shot")

    def cut_off(self, req: RequestState) -> bool:
        """A relay finished ``req`` before the main decoder held its KV: cut the WAN transfer
        off (True) or let it complete into the main decoder's cache (False)?"""
        return True

    def on_event(self, req: RequestState, event: Event) -> None:  # noqa: B027
        """React to a worker event for ``req`` (default: nothing)."""

    def on_end(self, req: RequestState, error: str | None) -> None:  # noqa: B027
        """``req`` left the router: completed (``error`` None) or failed, however it failed,
        including by the router itself (a timeout, a dead worker) with no event from a
        worker (default: nothing)."""

    @property
    def nbytes(self) -> int:
        """Memory the policy's own indexes hold (the router's memory floor leaves it out)."""
        return 0

    def stats(self) -> PolicyReport:
        """Policy-level counters for the run's summary."""
        return PolicyReport(options=self.describe())

    def describe(self) -> str:
        """The name with every option, defaults included."""
        shown = ",".join(f"{k}={spell(v)}" for k, v in self.opts.model_dump().items() if v is not None)
        return f"{self.name}:{shown}" if shown else self.name
