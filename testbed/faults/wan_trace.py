"""A WAN that changes over time: a link trace replayed in emulated time.

A direction of the line (``wan.forward.trace`` / ``wan.reverse.trace`` in a scenario, or
``--wan-trace FILE`` for both) takes one of two formats:

* **CSV** (``.csv``): ``t_s,rate_mbit[,delay_ms[,loss_pct]]`` per line, a header line
  allowed, ``#`` comments; from ``t_s`` on, the line runs at that rate (and one-way delay,
  and loss) until the next line's time; the last line holds to the end of the run. With the
  header ``t_s,rate_pct,...`` rates are percent of the scenario's rate for that direction,
  so one shape fits any line.
* **Mahimahi** (anything else): one integer per line, the millisecond of a delivery
  opportunity of one 1,500-byte packet (Mahimahi's link traces). Opportunities are counted
  per ``MAHIMAHI_BIN_S`` into a rate; consecutive equal rates are merged. Played once (the
  last bin holds), not looped.

Times are emulated seconds from the replay's start, rates emulated Mbit/s (mapped to the
wire by the run's emulation, like every rate). A trace becomes fault-timeline entries
(``faults_of``): per step a ``rate`` fault, a ``delay`` fault for what its delay adds to
the scenario's, a ``loss`` fault, so it is applied, logged and saved like any fault, and
combines with them (the lowest rate wins). A delay below the scenario's is an error: the
scenario's delay is the line's propagation, which no trace can shorten.

The file is read and checked once, when the scenario is loaded; errors name file:line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault, Fault, parse_fault
from testbed.traces.line_errors import from_validation, line_error, read_lines

MAHIMAHI_BIN_S = 1.0
MAHIMAHI_PACKET_BYTES = 1500
MAX_STEPS = 10_000


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t_s: float = Field(ge=0)
    rate_mbit: float = Field(gt=0)
    delay_ms: float | None = Field(default=None, ge=0, le=10_000)
    loss_pct: float | None = Field(default=None, ge=0, lt=100)


class WanTrace(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # the file, as given
    format: str  # csv | mahimahi
    relative: bool = False  # rates are percent of the direction's own rate (a rate_pct header)
    steps: list[Step] = Field(min_length=1, max_length=MAX_STEPS)


def _csv(path: Path, lines: list[str]) -> tuple[list[Step], bool]:
    out: list[Step] = []
    names = ("t_s", "rate_mbit", "delay_ms", "loss_pct")
    relative = False
    for n, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        cells = [c.strip() for c in text.split(",")]
        if not out and cells[0] == "t_s":  # the header
            if len(cells) < 2 or cells[1] not in ("rate_mbit", "rate_pct"):
                raise line_error(path, n, "(header)", "expected t_s,rate_mbit or t_s,rate_pct first")
            relative = cells[1] == "rate_pct"
            continue
        if not 2 <= len(cells) <= 4:
            raise line_error(path, n, "(line)", f"expected t_s,rate_mbit[,delay_ms[,loss_pct]], got {len(cells)} "
                             "fields")
        values: dict[str, float] = {}
        for name, cell in zip(names, cells, strict=False):
            if cell == "" and name in ("delay_ms", "loss_pct"):
                continue
            try:
                values[name] = float(cell)
            except ValueError:
                raise line_error(path, n, name, f"not a number: {cell!r}") from None
        try:
            step = Step.model_validate(values)
        except ValidationError as e:
            raise from_validation(path, n, e) from None
        if out and step.t_s <= out[-1].t_s:
            raise line_error(path, n, "t_s", f"{step.t_s:g} does not follow {out[-1].t_s:g}")
        out.append(step)
    return out, relative


def _mahimahi(path: Path, lines: list[str]) -> list[Step]:
    times: list[int] = []
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            ms = int(text)
        except ValueError:
            raise line_error(path, n, "(line)", f"not a millisecond count: {text!r}") from None
        if ms < 0 or (times and ms < times[-1]):
            raise line_error(path, n, "(line)", f"{ms} ms goes back in time")
        times.append(ms)
    if not times:
        return []
    bins = int(times[-1] / 1000 / MAHIMAHI_BIN_S) + 1
    counts = [0] * bins
    for ms in times:
        counts[int(ms / 1000 / MAHIMAHI_BIN_S)] += 1
    out: list[Step] = []
    for i, c in enumerate(counts):
        rate = max(c, 1) * MAHIMAHI_PACKET_BYTES * 8 / MAHIMAHI_BIN_S / 1e6  # an empty bin: a trickle, not zero
        if not out or rate != out[-1].rate_mbit:
            out.append(Step(t_s=i * MAHIMAHI_BIN_S, rate_mbit=rate))
    return out


def load_wan_trace(path: Path) -> WanTrace:
    """Read and check a link trace (the module docstring's formats); InputError names file:line."""
    lines = read_lines(path)
    fmt = "csv" if path.suffix.lower() == ".csv" else "mahimahi"
    steps, relative = _csv(path, lines) if fmt == "csv" else (_mahimahi(path, lines), False)
    if not steps:
        raise InputError(f"{path}: no step in this link trace")
    if len(steps) > MAX_STEPS:
        raise InputError(f"{path}: {len(steps)} steps, at most {MAX_STEPS} (a coarser trace, please)")
    return WanTrace(source=str(path), format=fmt, relative=relative, steps=steps)


def as_wan_trace(value: object) -> object:
    """A scenario's ``trace:`` is a file name: read here, once (errors reach the scenario's
    own report with the field's position)."""
    if isinstance(value, str | Path):
        try:
            return load_wan_trace(Path(value))
        except InputError as e:
            raise ValueError(str(e)) from None
    return value


class LineDirection(Protocol):
    """What a direction of the scenario's line says (``testbed.scenario.WanDirection``)."""

    @property
    def rate_mbit(self) -> float | None: ...
    @property
    def delay_ms(self) -> float: ...
    @property
    def trace(self) -> WanTrace | None: ...


def _direction_faults(name: str, d: LineDirection) -> Iterable[Fault]:
    assert d.trace is not None and d.rate_mbit is not None
    steps = d.trace.steps
    for i, s in enumerate(steps):
        dur = steps[i + 1].t_s - s.t_s if i + 1 < len(steps) else None
        common = {"at_s": s.t_s, "duration_s": dur, "dir": name}
        mbit = s.rate_mbit * d.rate_mbit / 100 if d.trace.relative else s.rate_mbit
        yield Fault.model_validate({"kind": "rate", "mbit": round(mbit, 3), **common})
        if s.delay_ms is not None:
            extra = s.delay_ms - d.delay_ms
            if extra < -1e-9:
                raise InputError(f"{d.trace.source}: step at {s.t_s:g} s: delay_ms {s.delay_ms:g} is below the "
                                 f"scenario's {d.delay_ms:g} ms for {name}")
            if extra > 0:
                yield Fault.model_validate({"kind": "delay", "ms": extra, **common})
        if s.loss_pct:
            yield Fault.model_validate({"kind": "loss", "pct": s.loss_pct, **common})


def faults_of(directions: Mapping[str, LineDirection]) -> list[Fault]:
    """The fault-timeline entries of the link traces of a line's directions (by name,
    ``a->b``; none without a trace)."""
    out: list[Fault] = []
    for name, d in directions.items():
        if d.trace is not None:
            if d.rate_mbit is None:
                raise InputError(f"wan {name} has a trace but no rate_mbit (an unshaped line has no "
                                 "rate to change)")
            out += _direction_faults(name, d)
    return out


def rate_history(directions: Mapping[str, LineDirection],
                 applied: list[AppliedFault]) -> dict[str, list[tuple[float, float]]]:
    """Per direction, the line's rate over the run as the faults were applied: (emulated s,
    Mbit/s) at the start and at every change (the scenario's rate between faults)."""
    base = {name: d.rate_mbit for name, d in directions.items()}
    events: list[tuple[float, int, Fault]] = []
    for entry in applied:
        if entry.kind != "rate" or entry.applied_s is None:
            continue
        f = parse_fault(entry.fault, "a saved fault")
        events.append((entry.applied_s, 1, f))
        if entry.cleared_s is not None:
            events.append((entry.cleared_s, 0, f))
    out: dict[str, list[tuple[float, float]]] = {}
    for name, rate in base.items():
        if rate is None:
            continue
        active: list[Fault] = []
        history = [(0.0, rate)]
        for t, on, f in sorted(events, key=lambda e: (e[0], e[1])):
            if f.dir not in (name, "both"):
                continue
            if on:
                active.append(f)
            elif f in active:
                active.remove(f)
            now = min((x.mbit or rate for x in active), default=rate)
            if now != history[-1][1]:
                history.append((t, now))
        out[name] = history
    return out
