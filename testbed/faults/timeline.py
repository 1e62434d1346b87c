"""A fault timeline, described: what breaks, when (emulated seconds from the replay's start),
for how long, and how.

A fault is written ``KIND@START[+DURATION][:key=value,...]`` on the command line
(``--fault``, repeatable) or in a scenario's ``faults:`` list (the same strings, or mappings
with the same fields). ``parse_fault`` turns a string into a validated ``Fault``; every error
names the spec and the field. Kinds and their keys:

==================  ====================================  =======================================
kind                keys                                  what happens
==================  ====================================  =======================================
``wan-down``        ``dir`` = a->b | b->a | both (both)   every frame of that direction is dropped
``loss``            ``pct`` (required), ``dir``           random loss at ``pct`` percent
``delay``           ``ms`` (required), ``dir``            ``ms`` added to the one-way delay
``rate``            ``mbit`` (required), ``dir``          the line's rate drops to ``mbit``
``partition``       ``dc`` (required)                     the datacenter is cut off: both directions
``kill``            ``host`` (required)                   SIGKILL of the worker on that host; with
                                                          a DURATION it is started again after it
``broker-restart``  none                                  the broker stops; it restarts after
                                                          DURATION (0 if none)
``broker-stop``     none (no DURATION)                    the broker stops for good: every client
                                                          fails its open requests once it has not
                                                          reached it for a grace period
``router-kill``     none (no DURATION)                    SIGKILL of the router; its last will
                                                          tells the clients, which fail what it held
``clock-step``      ``s`` (required), ``host``             the wall clock of the component on
                    (default: every component)            ``host`` (a worker, the router or the
                                                          client) jumps ``s`` seconds (negative:
                                                          back); with a DURATION it jumps back
                                                          after it. Only the component's own clock
                                                          (``protocol.clock``), never the host's
==================  ====================================  =======================================

A fault without a duration lasts until the run ends (a killed worker stays dead). Values
are the *emulated* system's (delay, rate): the injector maps them to the wire with the
run's emulation, as for the scenario's own WAN. This module only describes;
``testbed.deploy.fault_injection`` applies a timeline to a running emulation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.clock import MAX_STEP_S
from protocol.validation import first_error
from testbed.errors import InputError

FaultKind = Literal["wan-down", "loss", "delay", "rate", "partition", "kill", "broker-restart", "broker-stop",
                    "router-kill", "clock-step"]
FOR_GOOD = ("broker-stop", "router-kill")  # nothing brings them back within the run
Direction = Literal["a->b", "b->a", "both"]
NETWORK_KINDS = ("wan-down", "loss", "delay", "rate", "partition")
_KEYS: dict[str, tuple[set[str], set[str]]] = {  # kind -> (required keys, optional keys)
    "wan-down": (set(), {"dir"}),
    "loss": ({"pct"}, {"dir"}),
    "delay": ({"ms"}, {"dir"}),
    "rate": ({"mbit"}, {"dir"}),
    "partition": ({"dc"}, set()),
    "kill": ({"host"}, set()),
    "broker-restart": (set(), set()),
    "broker-stop": (set(), set()),
    "router-kill": (set(), set()),
    "clock-step": ({"s"}, {"host"}),
}
WORKER_ROLES = ("prefill", "decode", "relay-decode", "colocated")  # the roles a kill may name
_VALUED = ("pct", "ms", "mbit", "dc", "host", "s")  # the keys with a value of their own
_SPEC_RE = re.compile(r"^(?P<kind>[a-z-]+)@(?P<at>[^+:]+)(\+(?P<dur>[^:]+))?(:(?P<kv>.*))?$")


class Fault(BaseModel):
    """One fault of a timeline. ``dir`` names the scenario's datacenters in WAN order as
    ``a``/``b`` only when those are its names; otherwise use the real names (``x->y``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind
    at_s: float = Field(ge=0, description="emulated seconds after the replay's first request was due")
    duration_s: float | None = Field(default=None, gt=0, description="None: until the run ends")
    dir: str = "both"
    pct: float | None = Field(default=None, gt=0, le=100)
    ms: float | None = Field(default=None, gt=0, le=600_000)
    mbit: float | None = Field(default=None, gt=0)
    dc: str | None = None
    host: str | None = None
    s: float | None = Field(default=None, ge=-MAX_STEP_S, le=MAX_STEP_S, description="a clock step, seconds")

    @model_validator(mode="after")
    def _keys_of_kind(self) -> Fault:
        required, optional = _KEYS[self.kind]
        given = {k for k in _VALUED if getattr(self, k) is not None}
        if self.dir != "both":
            given.add("dir")
        if self.kind in FOR_GOOD and self.duration_s is not None:
            raise ValueError(f"{self.kind} takes no duration: it lasts until the run ends")
        missing = sorted(required - given)
        if missing:
            raise ValueError(f"{self.kind} needs {', '.join(missing)}")
        if self.s == 0:
            raise ValueError("s: a clock step of 0 s changes nothing")
        extra = sorted(given - required - optional)
        if extra:
            raise ValueError(f"{self.kind} takes no {', '.join(extra)}")
        if self.dir != "both" and not re.fullmatch(r"[a-z][a-z0-9]{0,7}->[a-z][a-z0-9]{0,7}", self.dir):
            raise ValueError(f"dir must be both or SRC->DST (datacenter names), got {self.dir!r}")
        return self

    @property
    def end_s(self) -> float | None:
        return None if self.duration_s is None else self.at_s + self.duration_s

    @property
    def label(self) -> str:
        """The fault as it would be written on the command line."""
        text = f"{self.kind}@{self.at_s:g}" + (f"+{self.duration_s:g}" if self.duration_s is not None else "")
        keys = [f"{k}={getattr(self, k):g}" if isinstance(getattr(self, k), float) else f"{k}={getattr(self, k)}"
                for k in ("dir", *_VALUED)
                if getattr(self, k) is not None and not (k == "dir" and self.dir == "both")]
        return text + (":" + ",".join(keys) if keys else "")

    def check_against(self, datacenters: list[str], hosts: dict[str, str], unshaped: set[str] | None = None) -> None:
        """Names the scenario must have (``hosts``: host of a component -> its role;
        ``unshaped``: WAN directions without a rate, which a rate fault cannot change).
        Raises ValueError."""
        if self.dir != "both":
            src, dst = self.dir.split("->")
            if {src, dst} != set(datacenters):
                raise ValueError(f"dir {self.dir!r}: the datacenters are {' and '.join(datacenters)}")
        if self.dc is not None and self.dc not in datacenters:
            raise ValueError(f"dc {self.dc!r}: the datacenters are {' and '.join(datacenters)}")
        if self.host is not None:
            can = sorted(h for h, role in hosts.items() if self.kind == "clock-step" or role in WORKER_ROLES)
            if self.host not in can:
                what = "component" if self.kind == "clock-step" else "worker"
                raise ValueError(f"host {self.host!r} runs no {what} ({what}s on: {', '.join(can)})")
        if self.kind == "rate":
            a, b = datacenters
            for name in [f"{a}->{b}", f"{b}->{a}"] if self.dir == "both" else [self.dir]:
                if name in (unshaped or set()):
                    raise ValueError(f"WAN {name} has no rate to drop (rate_mbit is not set)")


class AppliedFault(BaseModel):
    """One fault as it happened (times in emulated seconds from the replay's start)."""

    model_config = ConfigDict(frozen=True)

    fault: str  # the spec, as written on the command line
    kind: str
    at_s: float
    applied_s: float | None = None  # None: never applied (the replay ended first, or an error)
    cleared_s: float | None = None  # None: lasted until the end of the run
    detail: str = ""
    error: str | None = None

    def active_between(self, start_s: float, end_s: float) -> bool:
        """Whether this fault was in effect at some point of [start_s, end_s]."""
        if self.applied_s is None:
            return False
        return self.applied_s <= end_s and (self.cleared_s is None or self.cleared_s >= start_s)


def _number(text: str, what: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise ValueError(f"{what}: expected seconds, got {text!r}") from None
    return value


def _parse(text: str) -> Fault:
    """``KIND@START[+DURATION][:key=value,...]`` -> ``Fault``; ValueError says what is wrong."""
    m = _SPEC_RE.match(text.strip())
    if not m:
        raise ValueError("expected KIND@START[+DURATION][:key=value,...], e.g. wan-down@20+5 or "
                         "kill@40:host=decode-b")
    fields: dict[str, object] = {"kind": m["kind"], "at_s": _number(m["at"], "START")}
    if m["dur"] is not None:
        fields["duration_s"] = _number(m["dur"], "DURATION")
    for pair in filter(None, (m["kv"] or "").split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected key=value, got {pair!r}")
        fields[key.strip()] = value.strip()
    try:
        return Fault.model_validate(fields)
    except ValidationError as e:
        raise ValueError(first_error(e, "spec")) from None


def parse_fault(text: str, where: str = "--fault") -> Fault:
    """A command-line fault; InputError naming ``where`` and the spec."""
    try:
        return _parse(text)
    except ValueError as e:
        raise InputError(f"{where} {text!r}: {e}") from None


def parse_faults(texts: list[str], check: Callable[[Fault], None]) -> tuple[Fault, ...]:
    """Command-line faults, each also ``check``-ed against the scenario (ValueError there
    becomes an InputError naming the spec)."""
    out = []
    for text in texts:
        fault = parse_fault(text)
        try:
            check(fault)
        except ValueError as e:
            raise InputError(f"--fault {text!r}: {e}") from None
        out.append(fault)
    return tuple(out)


def as_fault(value: object) -> object:
    """Scenario ``faults:`` entries may be spec strings: parsed here (pydantic reports errors
    with the entry's position); mappings are validated as ``Fault``."""
    return _parse(value) if isinstance(value, str) else value
