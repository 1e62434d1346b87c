"""Trace formats: Mooncake JSONL, Azure LLM inference CSV, native agentic sessions, request lists.

Each loader validates every line before anything runs and raises ``InputError`` naming
``file:line: field``; it returns a ``Workload`` (see ``workload.py``). ``token_scale`` N
divides every length (and the Mooncake block size) by N, rounding lengths up.

Formats are documented with examples in ``traces/README.md``.
"""

from __future__ import annotations

import csv
import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    model_validator,
)

from protocol.messages import SAFE_NAME, RequestHints
from testbed.errors import InputError
from testbed.traces.agentic_mooncake import load_agentic_mooncake
from testbed.traces.bailian import load_bailian
from testbed.traces.burstgpt import BURSTGPT_COLUMNS, load_burstgpt
from testbed.traces.cc_traces import load_cc_traces
from testbed.traces.copilot import load_copilot
from testbed.traces.line_errors import line_error, read_lines
from testbed.traces.lines import MAX_SECONDS, MAX_TOKENS, Number, Seconds, Tokens, json_lines, parse_line
from testbed.traces.tracelab import TRACELAB_COLUMNS, load_tracelab
from testbed.traces.workload import VOCAB_HIGH, Segment, TraceRequest, Workload, scale_len

MOONCAKE_BLOCK = 512
FORMATS = ("mooncake", "azure", "sessions", "requests", "bailian", "tracelab", "burstgpt", "copilot-agent",
           "cc-traces", "agentic-mooncake")
SESSIONS_FORMAT = "pdd-sessions"

def _non_empty(path: Path, reqs: list[TraceRequest]) -> list[TraceRequest]:
    if not reqs:
        raise InputError(f"{path}: no requests")
    return reqs


# ------------------------------------------------------------------------------ Mooncake
class MooncakeLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    timestamp: Number = Field(ge=0, le=1000 * MAX_SECONDS)  # ms
    input_length: Tokens
    output_length: Tokens
    hash_ids: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)


def load_mooncake(path: Path, token_scale: int = 1) -> Workload:
    block = max(1, MOONCAKE_BLOCK // token_scale)
    reqs, last = [], 0.0
    for i, obj in json_lines(path):
        r: MooncakeLine = parse_line(MooncakeLine, path, i, obj)
        n = len(r.hash_ids)
        if n * MOONCAKE_BLOCK < r.input_length:
            raise line_error(path, i, "hash_ids", f"{n} blocks of {MOONCAKE_BLOCK} tokens cannot cover "
                                                  f"input_length {r.input_length}")
        if (n - 1) * MOONCAKE_BLOCK >= r.input_length:
            raise line_error(path, i, "hash_ids", f"{n} blocks for input_length {r.input_length}: "
                                                  f"the last block would be empty")
        if r.timestamp < last:
            raise line_error(path, i, "timestamp", f"goes backwards ({r.timestamp} < {last})")
        last = r.timestamp
        want = min(scale_len(r.input_length, token_scale), n * block)
        segs = []
        for h in r.hash_ids:
            take = min(block, want - sum(s.n for s in segs))
            segs.append(Segment(f"mooncake:{h}:{block}", take))
        reqs.append(TraceRequest(f"m{i:06d}", segs, scale_len(r.output_length, token_scale),
                                 at=r.timestamp / 1000.0, line=i))
    return Workload(path, "mooncake", _non_empty(path, reqs), token_scale, block)


# ------------------------------------------------------------------------------ Azure
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_time(raw: str) -> float:
    """Seconds: a number, or an ISO date-time (Azure writes 7 fractional digits)."""
    try:
        return float(raw)
    except ValueError:
        pass
    head, dot, frac = raw.strip().partition(".")
    text = head + (dot + frac[:6] if dot else "")
    return dt.datetime.fromisoformat(text).timestamp()


def load_azure(path: Path, token_scale: int = 1) -> Workload:
    lines = read_lines(path)
    reader = csv.DictReader(lines)
    missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise line_error(path, 1, "header", f"missing column(s) {', '.join(missing)} "
                                            f"(expected {', '.join(AZURE_COLUMNS)})")
    reqs: list[TraceRequest] = []
    t0 = last = None
    for row in reader:
        i = reader.line_num
        vals: dict[str, Any] = {}
        for col in AZURE_COLUMNS[1:]:
            raw = (row.get(col) or "").strip()
            try:
                vals[col] = int(raw) if len(raw) <= 20 else None
            except ValueError:
                vals[col] = None
            if vals[col] is None:
                raise line_error(path, i, col, f"expected an integer, got {raw[:40]!r}")
            if not 1 <= vals[col] <= MAX_TOKENS:
                raise line_error(path, i, col, f"must be in 1..{MAX_TOKENS}, got {vals[col]}")
        raw_t = (row.get("TIMESTAMP") or "").strip()
        try:
            t = _azure_time(raw_t[:64])
            if not -MAX_SECONDS * 10 <= t <= MAX_SECONDS * 10:  # a date, or seconds: finite and plausible
                raise ValueError(raw_t)
        except (ValueError, OverflowError) as e:
            raise line_error(path, i, "TIMESTAMP", f"not a time: {raw_t[:40]!r}") from e
        if last is not None and t < last:
            raise line_error(path, i, "TIMESTAMP", f"goes backwards ({raw_t})")
        t0 = t if t0 is None else t0
        last = t
        n = scale_len(vals["ContextTokens"], token_scale)
        reqs.append(TraceRequest(f"z{i:06d}", [Segment(f"azure:{path.name}:{i}", n)],
                                 scale_len(vals["GeneratedTokens"], token_scale), at=t - t0, line=i))
    return Workload(path, "azure", _non_empty(path, reqs), token_scale, max(1, MOONCAKE_BLOCK // token_scale))


# ------------------------------------------------------------------------------ sessions
class SharedPrefix(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    tokens: Tokens


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    new_tokens: Tokens = Field(description="tool results / user text appended this turn")
    output_tokens: Tokens
    delay_s: Seconds | None = Field(default=None, description="closed loop: after the previous turn ends")
    at_s: Seconds | None = Field(default=None, description="open loop: offset from the session start")
    short_output: StrictBool = False  # hint a policy may use
    tag: str | None = None


class Session(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: str = Field(pattern=SAFE_NAME, max_length=120)  # request ids are "<session>.<turn>"
    start_s: Seconds
    shared_prefix: SharedPrefix | None = None
    turns: list[Turn] = Field(min_length=1)



class SessionsHeader(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: str
    version: StrictInt = 1


def _check_turn_timing(path: Path, line: int, s: Session) -> None:
    last_at = 0.0
    for k, t in enumerate(s.turns):
        if t.delay_s is not None and t.at_s is not None:
            raise line_error(path, line, f"turns.{k}", "give delay_s or at_s, not both")
        if k == 0 and t.delay_s is not None:
            raise line_error(path, line, "turns.0.delay_s", "the first turn starts at start_s (use at_s)")
        if t.at_s is not None:
            if t.at_s < last_at:
                raise line_error(path, line, f"turns.{k}.at_s", f"goes backwards ({t.at_s} < {last_at})")
            last_at = t.at_s


def load_sessions(path: Path, token_scale: int = 1) -> Workload:
    return sessions_workload(path, json_lines(path), token_scale)


def sessions_workload(path: Path, lines: Iterable[tuple[int, dict[str, Any]]], token_scale: int = 1) -> Workload:
    """Sessions given as (line number, JSON object) pairs; ``path`` names them in errors."""
    reqs: list[TraceRequest] = []
    meta: dict[str, Any] = {}
    seen: dict[str, int] = {}
    last = 0.0
    for i, obj in lines:
        if "format" in obj and not reqs and not meta:
            hdr: SessionsHeader = parse_line(SessionsHeader, path, i, obj)
            if hdr.format != SESSIONS_FORMAT:
                raise line_error(path, i, "format", f"expected {SESSIONS_FORMAT!r}, got {hdr.format!r}")
            meta = {k: v for k, v in obj.items() if k not in ("format", "version")}
            continue
        s: Session = parse_line(Session, path, i, obj)
        if s.session in seen:
            raise line_error(path, i, "session", f"{s.session!r} already defined on line {seen[s.session]}")
        seen[s.session] = i
        if s.start_s < last:
            raise line_error(path, i, "start_s", f"goes backwards ({s.start_s} < {last})")
        last = s.start_s
        _check_turn_timing(path, i, s)
        ctx: list[Segment] = []
        if s.shared_prefix:
            ctx.append(Segment(f"shared:{s.shared_prefix.id}", scale_len(s.shared_prefix.tokens, token_scale)))
        prev: str | None = None
        for k, t in enumerate(s.turns):
            ctx = [*ctx, Segment(f"session:{s.session}:in{k}", scale_len(t.new_tokens, token_scale))]
            rid = f"{s.session}.{k}"
            out = scale_len(t.output_tokens, token_scale)
            hints = RequestHints(short_output=bool(t.short_output), tag=t.tag or None)
            if t.delay_s is not None:
                req = TraceRequest(rid, ctx, out, after=prev, delay=float(t.delay_s), session=s.session,
                                   turn=k, line=i, hints=hints)
            else:
                req = TraceRequest(rid, ctx, out, at=float(s.start_s + (t.at_s or 0.0)), session=s.session,
                                   turn=k, line=i, hints=hints)
            reqs.append(req)
            # The next turn's context holds this turn's output. It is represented by
            # deterministic stand-in tokens of the recorded length, so every prompt is fixed
            # before the run: reproducible, identical across policies, and what `trace stats`
            # analyses. The request carries them as its answer: what a scenario that keeps
            # answers cached (`workers.cache_outputs`) caches on the prefill side.
            answer = Segment(f"session:{s.session}:out{k}", out)
            if k + 1 < len(s.turns):
                req.answer = answer
            ctx = [*ctx, answer]
            prev = rid
    return Workload(path, "sessions", _non_empty(path, reqs), token_scale,
                    max(1, MOONCAKE_BLOCK // token_scale), meta)


# ------------------------------------------------------------------------------ request lists
class RequestLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = Field(default=None, pattern=SAFE_NAME)
    prompt: list[StrictInt] | None = None
    input_length: Tokens | None = None
    prefix: str | None = None
    prefix_length: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS)
    output_length: Tokens
    arrival_s: Seconds = 0.0

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestLine:
        if (self.prompt is None) == (self.input_length is None):
            raise ValueError("give exactly one of prompt or input_length")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt is not None and not all(0 <= t < VOCAB_HIGH for t in self.prompt):
            bad = next(t for t in self.prompt if not 0 <= t < VOCAB_HIGH)
            raise ValueError(f"token id {bad} is outside the default model's vocabulary [0, {VOCAB_HIGH})")
        if self.input_length is not None and self.prefix_length > self.input_length:
            raise ValueError("prefix_length exceeds input_length")
        return self


def load_requests(path: Path, token_scale: int = 1) -> Workload:
    """Simple request lists: explicit ``prompt`` token IDs (never scaled) or ``input_length``
    with an optional shared ``prefix`` group."""
    reqs, last = [], 0.0
    for i, obj in json_lines(path):
        r: RequestLine = parse_line(RequestLine, path, i, obj)
        if r.arrival_s < last:
            raise line_error(path, i, "arrival_s", f"goes backwards ({r.arrival_s} < {last})")
        last = r.arrival_s
        if r.prompt is not None:
            segs = [Segment("literal", len(r.prompt), tuple(r.prompt))]
        else:
            assert r.input_length is not None
            n = scale_len(r.input_length, token_scale)
            head = min(n, r.prefix_length // token_scale) if r.prefix else 0
            segs = [Segment(f"prefix:{r.prefix}", head)] if head else []
            segs.append(Segment(f"request:{path.name}:{i}", n - head))
        reqs.append(TraceRequest(r.rid or f"r{i:05d}", segs, scale_len(r.output_length, token_scale),
                                 at=float(r.arrival_s), line=i))
    rids = [r.rid for r in reqs]
    if len(set(rids)) != len(rids):
        dup = next(r for r in reqs if rids.count(r.rid) > 1)
        raise line_error(path, dup.line, "rid", f"{dup.rid!r} is not unique")
    return Workload(path, "requests", _non_empty(path, reqs), token_scale, max(1, MOONCAKE_BLOCK // token_scale))


# ------------------------------------------------------------------------------ dispatch
LOADERS = {"mooncake": load_mooncake, "azure": load_azure, "sessions": load_sessions, "requests": load_requests,
           "bailian": load_bailian, "tracelab": load_tracelab, "burstgpt": load_burstgpt,
           "copilot-agent": load_copilot, "cc-traces": load_cc_traces, "agentic-mooncake": load_agentic_mooncake}


def detect_format(path: Path) -> str:
    if path.name.lower().endswith((".csv", ".csv.gz")):
        header = {h.strip() for h in next(iter(read_lines(path)), "").split(",")}
        for fmt, columns in (("tracelab", TRACELAB_COLUMNS), ("burstgpt", BURSTGPT_COLUMNS)):
            if set(columns) <= header:
                return fmt
        return "azure"
    for _, obj in json_lines(path):
        if "chat_id" in obj:
            return "bailian"
        calls = obj.get("requests")
        if isinstance(calls, list) and calls and isinstance(calls[0], dict) and "hash_ids" in calls[0]:
            return "cc-traces"
        if "hash_ids" in obj:
            return "agentic-mooncake" if "session_id" in obj or "wait_for" in obj else "mooncake"
        turns = obj.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "llm_calls" in turns[0]:
            return "copilot-agent"
        if "turns" in obj or obj.get("format") == SESSIONS_FORMAT:
            return "sessions"
        return "requests"
    raise InputError(f"{path}: no requests")


def load_trace(path: Path, fmt: str = "auto", token_scale: int = 1, max_context: int | None = None) -> Workload:
    """Load and validate a whole trace (``fmt``: auto or one of FORMATS); ``max_context``:
    prompts longer than that many emulated tokens keep their last ones (``Workload.capped``)."""
    if max_context is not None and max_context < 1:
        raise InputError(f"--max-context: at least 1 token, got {max_context}")
    if token_scale < 1 or token_scale > MOONCAKE_BLOCK:
        raise InputError(f"--token-scale: must be between 1 and {MOONCAKE_BLOCK}, got {token_scale}")
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in LOADERS:
        raise InputError(f"--format: unknown trace format {fmt!r} (known: auto, {', '.join(FORMATS)})")
    return LOADERS[fmt](path, token_scale).capped(max_context)
