"""Control plane: every message that travels on the MQTT topics (``protocol.topics`` says
which topic carries which, and who may write it), in one place.

Commands and events are tagged unions (``op`` / ``kind``): each variant states exactly the
fields it carries, with types and ranges, so a policy author reads the contract here
instead of in the worker that consumes it. ``parse_command`` / ``parse_event`` validate a
payload; a payload that fails names its request when it can (``rid_of``), so the receiver
fails that request alone and goes on serving the others.
"""

from __future__ import annotations

import re
import socket
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from protocol.validation import one_line
from protocol.worker_config import MAX_KV_CONNECTIONS, Contract, KvTransfer, WorkerRole

QOS = 1
# The longest prompt anything here carries (a request, a prefill command, a KV transfer's
# HELLO): a request's prompt and output together within it, or the router refuses it.
MAX_PROMPT_TOKENS = 1 << 20
# The largest message any component takes from the broker (the broker refuses larger ones
# too, ``message_size_limit``): a prefill command for the longest prompt a KV frame allows
# (``MAX_PROMPT_TOKENS``, ~11 bytes a token id in JSON) fits with room to spare.
MAX_MESSAGE_BYTES = 16 << 20


class Message(Contract):
    """A control-plane message: its numbers are finite (a peer's ``inf``/``nan`` would poison every sum)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# A request id or session name becomes part of an MQTT topic (``tokens/<rid>``), a file name
# and a CSV cell: ``/``, ``+``, ``#``, spaces and control characters would break them.
SAFE_NAME = r"^[A-Za-z0-9_.:=@-]{1,128}$"
RequestId = Annotated[str, Field(pattern=SAFE_NAME)]
_SAFE = re.compile(SAFE_NAME)
# A request's KV ticket for one receiver (``KVTarget.ticket``, ``DecodeCmd.ticket``): random hex
# from the router, empty where nobody set one (a hand-made command); see ``Hello.ticket``.
Ticket = Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")]
# A token id as a client may send it: 4 bytes, as the router holds prompts (policies/token_ids.py).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
# A token id as it streams back: what a token batch can carry (4 bytes, unsigned), and what a
# client's record holds (``array('I')``).
StreamedId = Annotated[int, Field(ge=0, lt=2**32)]


# ------------------------------------------------------------------------- client -> router
class RequestHints(Message):
    """What the trace says about a request beyond its tokens (policies may use it)."""

    session: RequestId | None = None
    turn: int = Field(default=0, ge=0)
    short_output: bool = False  # long input, short output: PDD's anomalous kind
    tag: str | None = None
    eager: int | None = Field(default=None, ge=0)  # fixed eager-token budget (verify, experiments)
    # The tokens the session's next turn carries as this turn's answer (a trace's stand-in):
    # what the prefill side caches after the request when the scenario keeps answers cached.
    answer: list[TokenId] | None = None


class Request(Message):
    rid: RequestId
    prompt: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    max_new: int = Field(ge=1, le=MAX_PROMPT_TOKENS)
    hints: RequestHints = RequestHints()
    ignore_eos: bool = False  # decode all ``max_new`` tokens even past the end-of-sequence token


class CancelRequest(Message):
    """A client no longer wants request ``rid`` (its HTTP client went away): the router ends
    it everywhere it runs."""

    rid: RequestId
    reason: str = Field(max_length=200)


# ------------------------------------------------------------------------- commands
class KVTarget(Message):
    worker: str
    host: str
    port: int = Field(ge=1, le=65535)
    ticket: Ticket = ""  # the receiver takes this request's KV only with it (its DecodeCmd has the same)


class PrefillCmd(Message):
    """Compute the prompt's KV (what the prefix cache lacks) and ship it to every target."""

    op: Literal["prefill"] = "prefill"
    rid: RequestId
    prompt: list[int] = Field(min_length=1)
    kv_to: list[KVTarget] = []
    kv_transfer: KvTransfer | None = None  # when the KV leaves (None: the worker's configured mode)
    # TCP connections each transfer uses at most (None: the worker's configured number)
    kv_connections: int | None = Field(default=None, ge=1, le=MAX_KV_CONNECTIONS)


class RelayPart(Message):
    """This decoder relays (PDD's RLD): it streams eager tokens, then hands over to ``main``."""

    main: str
    eager_budget: int | None = Field(default=None, ge=0)  # hand over after exactly this many


class MainPart(Message):
    """This decoder takes over from a relay (PDD's MD): it holds the KV until ``relay``'s
    eager tokens arrive by ``ExtendCmd``."""

    relay: str


class DecodeCmd(Message):
    """Expect the request's KV over TCP, then decode ``max_new`` tokens (or until EOS)."""

    op: Literal["decode"] = "decode"
    rid: RequestId
    prompt: list[int] = Field(min_length=1)
    max_new: int = Field(ge=1)
    ignore_eos: bool = False  # set by the router from the request, whatever the policy built
    drc: bool = True  # use and fill this decoder's radix cache
    relay: RelayPart | None = None
    main: MainPart | None = None
    ticket: Ticket = ""  # set by the router: the KV of this request is taken only from a HELLO carrying it

    @model_validator(mode="after")
    def _one_part(self) -> DecodeCmd:
        if self.relay is not None and self.main is not None:
            raise ValueError("a decoder either relays or takes over, not both")
        return self


class CancelCmd(Message):
    """Stop working on a request. On a prefill worker ``target`` cuts off only the transfer
    to that worker; on a decoder ``keep_kv`` keeps the arriving KV for the cache only."""

    op: Literal["cancel"] = "cancel"
    rid: RequestId
    target: str | None = None
    keep_kv: bool = False


class HandoffCmd(Message):
    """To a relay: the main decoder holds the KV; hand the stream over (``one-shot``: all
    eager tokens at once; ``catch-up``: batches of at most ``batch``) or, ``local``, finish
    the request here because the main decoder cannot take it."""

    op: Literal["handoff"] = "handoff"
    rid: RequestId
    mode: Literal["one-shot", "catch-up", "local"]
    batch: int = Field(default=64, ge=1)


class HandoffAck(Message):
    """To a relay: the main decoder has extended ``extended`` eager tokens (catch-up)."""

    op: Literal["handoff_ack"] = "handoff_ack"
    rid: RequestId
    extended: int = Field(ge=0)


class ExtendCmd(Message):
    """To a main decoder: eager token IDs at output indices ``start ..``; ``final`` hands
    the stream over."""

    op: Literal["extend"] = "extend"
    rid: RequestId
    start: int = Field(ge=0)
    tokens: list[int] = []
    final: bool = False


class WarmCmd(Message):
    """To a prefill instance, after a request completed: compute and cache the KV of
    ``tokens`` (its prompt, then its answer from ``start``) when no prefill is waiting, so the
    session's next turn finds the whole conversation cached (``workers.cache_outputs``)."""

    op: Literal["warm"] = "warm"
    rid: RequestId
    tokens: list[int] = Field(min_length=1)
    start: int = Field(ge=1)


Command = Annotated[PrefillCmd | DecodeCmd | CancelCmd | HandoffCmd | HandoffAck | ExtendCmd | WarmCmd,
                    Field(discriminator="op")]
_COMMAND: TypeAdapter[Command] = TypeAdapter(Command)


def parse_command(payload: bytes | bytearray | str) -> Command:
    """Validate a command; raises ``pydantic.ValidationError``."""
    return _COMMAND.validate_json(payload)


# ------------------------------------------------------------------------- events
class _Event(Message):
    rid: RequestId
    worker: str
    t: float


class PrefillDone(_Event):
    kind: Literal["prefill_done"] = "prefill_done"
    hit_tokens: int = Field(ge=0)
    computed: int = Field(ge=0)
    first_token: int
    start: float
    end: float
    real_s: float
    modeled_s: float | None = None


class KvSent(_Event):
    """A KV transfer ended at the sender (completed, or cut off when ``cancelled``)."""

    kind: Literal["kv_sent"] = "kv_sent"
    to: str
    bytes: int = Field(ge=0)  # acknowledged by the receiver's TCP
    written: int = Field(ge=0)
    payload: int = Field(ge=0)
    planned_payload: int = Field(ge=0)
    tokens: int = Field(ge=0)
    had: int = Field(ge=0)  # tokens the receiver already held
    start: float  # the transfer began (after its turn in the sender's queue for this peer)
    end: float
    queued_s: float = Field(default=0.0, ge=0)  # waited in that queue (real seconds)
    cancelled: bool = False
    in_flight: int = Field(default=0, ge=0)  # cut off: sent onto the network, not acknowledged


class KvReceived(_Event):
    kind: Literal["kv_received"] = "kv_received"
    bytes: int = Field(ge=0)
    had: int = Field(ge=0)
    start: float
    end: float
    cache_only: bool = False


class HandoffSent(_Event):
    """A relay sent eager tokens ``start .. start + tokens`` to the main decoder ``to``."""

    kind: Literal["handoff"] = "handoff"
    tokens: int = Field(ge=0)
    start: int = Field(ge=0)
    final: bool
    to: str


class Extended(_Event):
    kind: Literal["extended"] = "extended"
    tokens: int = Field(ge=0)
    start: int = Field(ge=0)
    final: bool
    mismatches: int = Field(ge=0)
    compute_s: float
    t_start: float
    since_kv_s: float


class Done(_Event):
    """The worker finished its part. On a relay ``handed_off`` says whether the main decoder
    took over (True) or the request ended on the relay (False)."""

    kind: Literal["done"] = "done"
    output_tokens: int = Field(ge=0)
    kv_bytes: int = Field(default=0, ge=0)
    handed_off: bool | None = None
    eager: int | None = None
    batches: list[int] = []
    taken_over_at: int | None = None


class Failed(_Event):
    kind: Literal["failed"] = "failed"
    reason: str
    target: str | None = None  # a KV transfer to this worker failed
    before_handoff: bool = False  # a main decoder failed while the relay still streams


Event = Annotated[PrefillDone | KvSent | KvReceived | HandoffSent | Extended | Done | Failed,
                  Field(discriminator="kind")]
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(payload: bytes | bytearray | str) -> Event:
    return _EVENT.validate_json(payload)


# ------------------------------------------------------------------------- streams and status
class Tokens(Message):
    """The router's own message on a request's topic (``tokens/<rid>``, which only it may
    write): a failure it reports itself, or, with ``streamers``, which workers will stream
    the request's tokens (readers take its chunks from those alone: ``protocol.stream_gate``)."""

    rid: RequestId
    start: int = Field(ge=0)  # index of the first token in this message within the output
    tokens: list[StreamedId]
    worker: str
    t: float
    done: bool = False
    error: str | None = None
    streamers: list[Annotated[str, Field(pattern=SAFE_NAME)]] | None = Field(default=None, min_length=1, max_length=2)


class Status(Message):
    worker: str
    role: WorkerRole
    state: Literal["up", "dead"]
    active: int = 0
    queued: int = 0
    host: str = ""
    kv_port: int = 0
    cache_hit_rate: float | None = None


class RouterStatus(Message):
    # "down": the router's last will (its process ended or lost the broker without a word)
    state: Literal["ready", "stopped", "down"]
    workers: dict[str, WorkerRole]  # name -> role
    policy: str


def no_delay(client: Any) -> None:
    """Send every packet of a connected ``aiomqtt.Client`` at once. paho leaves Nagle's
    algorithm on, so a token message would wait for the acknowledgement of the previous
    one (a WAN round trip from datacenter b) and tokens would arrive in bursts."""
    paho = getattr(client, "_client", None)  # aiomqtt has no public accessor for paho's socket
    sock = paho.socket() if paho is not None else None  # (a simulator's client has none)
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def why_invalid(error: ValidationError) -> str:
    """A validation error in one line: each failing field and what was wrong with it."""
    return one_line(error)


def rid_of(payload: bytes | bytearray | str) -> str | None:
    """The request id a (possibly malformed) message names, if it names a well-formed one
    (an id with ``#`` or ``/`` must never become a topic, a file name or a reply). Parsed as
    pydantic parses the message itself: bounded in size and depth (``json.loads`` of a
    payload nested a few thousand deep raises ``RecursionError``, which no handler expects)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    try:
        data = pydantic_core.from_json(payload)
    except ValueError:  # invalid JSON or UTF-8, nesting past the parser's limit, a number out of range
        return None
    rid = data.get("rid") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and _SAFE.fullmatch(rid) else None
