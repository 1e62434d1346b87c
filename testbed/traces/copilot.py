"""GitHub Copilot coding-agent traces (Azure public dataset, 2026): JSON lines (``.gz`` as
published), a session each.

Fields read (others ignored): ``session_id`` (optional: the line number otherwise),
``turns[].llm_calls[]`` with ``timestamp`` (seconds since the epoch, or an ISO 8601 time),
``duration_ms``, ``model`` (kept as the request's tag) and ``tokens{prompt, completion,
cached}``. ``tool_batches`` are not needed: their time is in the gap between one call's end
and the next call.

No hashes are published, only how many of a call's prompt tokens were cached. The rule that
turns them into shared prefixes: a session's calls run one after the other, and a call's
cached tokens are the head of the previous call's prompt. So call k's prompt is the first
``cached`` tokens of call k-1's prompt followed by ``prompt - cached`` new tokens, and its
planned hit is exactly the trace's cached share (in 64-token blocks); a ``cached`` count
longer than the previous prompt is cut to it and counted (``meta.cached_longer_than_previous``).

Replay, closed loop as published: a session's first call at its time; each next call once
the previous answer came back plus the gap the trace recorded after it (the next call's
timestamp minus the previous call's end: tool calls and the agent's own time).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr

from protocol.messages import RequestHints
from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_SECONDS, MAX_TOKENS, Number, Tokens, json_lines, parse_line
from testbed.traces.workload import Segment, TraceRequest, Workload, cut, scale_len

COPILOT_BLOCK = 64  # none is published: the planned hit is counted in 64-token blocks
MAX_CALLS = 100_000  # calls in one session


def _seconds(v: object) -> object:
    """An ISO 8601 time as seconds since the epoch; a number as it is (validated after)."""
    if isinstance(v, str) and len(v) <= 64:
        try:
            t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return v  # refused by the number check, naming the field
        return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()
    return v


Time = Annotated[Number, BeforeValidator(_seconds), Field(ge=0, le=1e11)]


class _Tokens(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: Tokens
    completion: Tokens
    cached: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS)


class _Call(BaseModel):
    model_config = ConfigDict(extra="ignore")

    timestamp: Time
    duration_ms: Number = Field(ge=0, le=1000 * MAX_SECONDS)
    model: StrictStr = Field(default="", max_length=64)
    tokens: _Tokens


class _Turn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    llm_calls: list[_Call] = Field(default=[], max_length=MAX_CALLS)


class CopilotSession(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: StrictStr | StrictInt | None = None
    turns: list[_Turn] = Field(min_length=1, max_length=MAX_CALLS)


def load_copilot(path: Path, token_scale: int = 1) -> Workload:
    reqs: list[TraceRequest] = []
    firsts: list[TraceRequest] = []
    seen: set[str] = set()
    clamped = 0
    for i, obj in json_lines(path):
        s: CopilotSession = parse_line(CopilotSession, path, i, obj)
        sid = str(s.session_id) if s.session_id is not None else f"line-{i}"
        if len(sid) > 64 or sid in seen:
            raise line_error(path, i, "session_id", f"{sid[:64]!r} " + ("seen before" if sid in seen
                                                                       else "longer than 64 characters"))
        seen.add(sid)
        calls = [c for t in s.turns for c in t.llm_calls]
        if not calls:
            raise line_error(path, i, "turns", "no llm_calls in any turn")
        if len(calls) > MAX_CALLS:
            raise line_error(path, i, "turns", f"{len(calls)} calls (at most {MAX_CALLS})")
        context: list[Segment] = []
        prev: _Call | None = None
        root = f"c{len(reqs):07d}"
        for k, c in enumerate(calls):
            where = f"turns: call {k}"
            if c.tokens.cached > c.tokens.prompt:
                raise line_error(path, i, f"{where}: tokens.cached", f"{c.tokens.cached} is more than its prompt "
                                                                     f"({c.tokens.prompt})")
            if prev is not None and c.timestamp < prev.timestamp:
                raise line_error(path, i, f"{where}: timestamp", "before the previous call's")
            total = scale_len(c.tokens.prompt, token_scale)
            want = min(scale_len(c.tokens.cached, token_scale), total) if c.tokens.cached else 0
            have = min(want, sum(x.n for x in context))
            clamped += have < want
            segs = cut(context, have)
            if total > have:
                segs.append(Segment(f"copilot:{path.name}:{i}:{k}", total - have))
            rid = f"c{len(reqs):07d}"
            hints = RequestHints(tag=c.model[:32] or None)
            out = scale_len(c.tokens.completion, token_scale)
            if prev is None:
                r = TraceRequest(rid, segs, out, at=c.timestamp, session=root, line=i, hints=hints)
                firsts.append(r)
            else:
                gap = max(0.0, c.timestamp - (prev.timestamp + prev.duration_ms / 1000))
                r = TraceRequest(rid, segs, out, after=reqs[-1].rid, delay=min(gap, MAX_SECONDS), session=root,
                                 turn=k, line=i, hints=hints)
            reqs.append(r)
            context, prev = segs, c
    if not reqs:
        raise line_error(path, 1, "(file)", "no sessions")
    t0 = min(r.at for r in firsts if r.at is not None)
    for r in firsts:  # first calls from the earliest
        r.at = (r.at or 0.0) - t0
    return Workload(path, "copilot-agent", reqs, token_scale, max(1, COPILOT_BLOCK // token_scale),
                    {"sessions": len(seen), "cached_longer_than_previous": clamped})
