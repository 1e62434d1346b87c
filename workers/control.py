"""Control plane: the MQTT topic layout and message schemas, in one place.

Every topic lives under ``pdd/<run_id>/``. QoS 1 for requests, commands, events and
tokens; MQTT keeps per-topic order for one publisher, so a request's token stream (one
topic, one publisher at a time) arrives in order.

    client/requests            client  -> router   Request
    worker/<name>/cmd          router  -> worker   Command (prefill | decode | cancel | handoff)
                               RLD     -> MD       Command (extend: eager token IDs)
                               MD      -> RLD      Command (handoff: ack of a catch-up batch)
    worker/<name>/status       worker  -> router   Status (retained; last will = dead)
    events                     worker  -> router   Event (kv_sent, handoff, extended, done, failed, ...)
    tokens/<rid>               worker  -> client   Tokens (and router -> client on failure)
    router/status              router  -> client   RouterStatus (retained)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

QOS = 1


class Topics:
    def __init__(self, run_id: str) -> None:
        self.root = f"pdd/{run_id}"

    @property
    def requests(self) -> str:
        return f"{self.root}/client/requests"

    def cmd(self, worker: str) -> str:
        return f"{self.root}/worker/{worker}/cmd"

    def status(self, worker: str) -> str:
        return f"{self.root}/worker/{worker}/status"

    @property
    def all_status(self) -> str:
        return f"{self.root}/worker/+/status"

    @property
    def events(self) -> str:
        return f"{self.root}/events"

    def tokens(self, rid: str) -> str:
        return f"{self.root}/tokens/{rid}"

    @property
    def all_tokens(self) -> str:
        return f"{self.root}/tokens/+"

    @property
    def router_status(self) -> str:
        return f"{self.root}/router/status"


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> bytes:
        return self.model_dump_json().encode()


class Request(Msg):
    rid: str
    prompt: list[int]
    max_new: int = Field(ge=1)
    meta: dict[str, Any] = {}


class KVTarget(Msg):
    worker: str
    host: str
    port: int


class Command(Msg):
    """``op``: prefill | decode | cancel (``options.target``: only the KV transfer to that
    worker) | handoff (to a relay decoder: the main decoder holds the KV; ``options.mode``
    one-shot | catch-up | local, ``options.batch``; or ``options.ack``: tokens the main
    decoder has extended so far) | extend (to a main decoder: eager token IDs ``tokens``
    starting at output index ``options.start``; ``options.final`` hands the stream over)."""

    op: Literal["prefill", "decode", "cancel", "handoff", "extend"]
    rid: str
    prompt: list[int] = []
    max_new: int = 1
    kv_to: list[KVTarget] = []  # prefill: where the KV goes
    tokens: list[int] = []  # extend: eager token IDs
    options: dict[str, Any] = {}


class Status(Msg):
    worker: str
    role: str
    state: Literal["up", "dead"]
    active: int = 0
    queued: int = 0
    host: str = ""
    kv_port: int = 0
    info: dict[str, Any] = {}


class Event(Msg):
    kind: Literal["prefill_done", "kv_sent", "kv_received", "handoff", "extended", "done", "failed"]
    rid: str
    worker: str
    t: float
    data: dict[str, Any] = {}


class Tokens(Msg):
    rid: str
    start: int  # index of the first token in this message within the output
    tokens: list[int]
    worker: str
    t: float
    done: bool = False
    error: str | None = None


class RouterStatus(Msg):
    state: Literal["ready", "stopped"]
    workers: dict[str, str]  # name -> role
    policy: str
