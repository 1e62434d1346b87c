"""NVIDIA Dynamo's ``agentic_mooncake`` traces: Mooncake rows (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids`` of **512**-token blocks) that also say how an
agent's calls depend on each other.

Fields read (others ignored): ``request_id`` (unique in the file), ``session_id`` (the agent
the call belongs to: its turns are numbered in file order), ``wait_for`` (the ids of earlier
rows this call waits for: it is sent once **every** one of them has completed, then
``delay`` + ``tool_wait_ms`` later: the agent's own pause and its tools' time, both in ms),
``branches`` (the ids of the rows that fork from this one: each must name it in its
``wait_for``; a check of the file, nothing replayed from it), ``prefix_reset`` (the session's
context was reset before this call: read, kept as the request's tag; the hash ids already say
what is shared) and ``timestamp`` (a call with no ``wait_for`` is sent at it, open loop, the
earliest such the replay's start; one with ``wait_for`` when its predecessors let it). Equal
hash ids are equal blocks across the file, as in Mooncake. A call whose predecessor failed is
not sent (an agent cannot go on without its answer). Field semantics beyond the names are
inferred from the format's description; ``docs/replay.md``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from protocol.messages import RequestHints
from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_SECONDS, MAX_TOKENS, Number, Tokens, json_lines, parse_line
from testbed.traces.workload import TraceRequest, Workload, hashed_blocks, scale_len

AGENTIC_BLOCK = 512  # Mooncake's
MAX_WAITS = 1024  # calls one call may wait for
ID = Field(min_length=1, max_length=128)


class AgenticRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: str = ID
    session_id: str = ID
    timestamp: Number = Field(default=0, ge=0, le=1000 * MAX_SECONDS)  # ms
    input_length: Tokens
    output_length: Tokens
    hash_ids: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)
    wait_for: list[str] = Field(default=[], max_length=MAX_WAITS)
    branches: list[str] = Field(default=[], max_length=MAX_WAITS)
    prefix_reset: StrictBool = False
    delay: Number = Field(default=0, ge=0, le=1000 * MAX_SECONDS)  # ms
    tool_wait_ms: Number = Field(default=0, ge=0, le=1000 * MAX_SECONDS)


def load_agentic_mooncake(path: Path, token_scale: int = 1) -> Workload:
    block = max(1, AGENTIC_BLOCK // token_scale)
    reqs: list[TraceRequest] = []
    rid_of: dict[str, str] = {}  # the trace's request ids -> ours
    rows: dict[str, tuple[int, AgenticRow]] = {}
    turns: dict[str, int] = {}
    for i, obj in json_lines(path):
        r: AgenticRow = parse_line(AgenticRow, path, i, obj)
        n = len(r.hash_ids)
        if n * AGENTIC_BLOCK < r.input_length or (n - 1) * AGENTIC_BLOCK >= r.input_length:
            raise line_error(path, i, "hash_ids", f"{n} blocks of {AGENTIC_BLOCK} tokens for input_length "
                                                  f"{r.input_length}")
        if r.request_id in rid_of:
            raise line_error(path, i, "request_id", f"{r.request_id!r} is not unique (line {rows[r.request_id][0]})")
        for k, w in enumerate(r.wait_for):
            if w not in rid_of:
                raise line_error(path, i, f"wait_for[{k}]", f"{w!r} is not the request_id of an earlier row")
        if len(set(r.wait_for)) != len(r.wait_for):
            raise line_error(path, i, "wait_for", "names a request twice")
        rid = f"am{i:06d}"
        rid_of[r.request_id] = rid
        rows[r.request_id] = (i, r)
        segs = hashed_blocks("agentic-mooncake", r.hash_ids, min(scale_len(r.input_length, token_scale), n * block),
                             block)
        waits = [rid_of[w] for w in r.wait_for]
        turn = turns.get(r.session_id, 0)
        turns[r.session_id] = turn + 1
        reqs.append(TraceRequest(rid, segs, scale_len(r.output_length, token_scale),
                                 at=None if waits else r.timestamp / 1000.0,
                                 after=waits[0] if waits else None, also_after=tuple(waits[1:]),
                                 delay=(r.delay + r.tool_wait_ms) / 1000.0 if waits else 0.0,
                                 session=f"am:{r.session_id}"[:64], turn=turn, line=i,
                                 hints=RequestHints(tag="prefix-reset" if r.prefix_reset else None)))
    if not reqs:
        raise line_error(path, 1, "(file)", "no requests")
    for request_id, (i, r) in rows.items():
        for k, b in enumerate(r.branches):
            if b not in rows or request_id not in rows[b][1].wait_for:
                raise line_error(path, i, f"branches[{k}]", f"{b!r} is not a row that waits for {request_id!r}")
    first = min((r.at for r in reqs if r.at is not None), default=0.0)
    for r in reqs:
        if r.at is not None:
            r.at -= first
    return Workload(path, "agentic-mooncake", reqs, token_scale, block)
