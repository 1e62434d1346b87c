"""SemiAnalysis cc-traces (coding-agent sessions, 2026): a JSON line per trace (an agent
session), its calls in ``requests``.

Fields read (others ignored): per trace ``requests`` (up to 13.7K calls a trace was published
with) and ``hash_id_scope`` (``local``: a trace's hash ids name blocks of that trace only, so
equal ids in two traces are different content; ``global``: one namespace for the file); per
call ``t`` (seconds; every trace of a file on one clock, the earliest call the replay's
start), ``model`` (kept as the request's tag), ``in`` and ``out`` (tokens), ``hash_ids`` (the
prompt's blocks of **64** tokens, equal ids equal content: prefixes shared between a session's
calls are cached as published) and ``api_time`` (the call's recorded duration: read, checked,
not replayed: the testbed's own engines answer). Replay: open loop, each call at its time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from protocol.messages import RequestHints
from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_TOKENS, Seconds, Tokens, json_lines, parse_line
from testbed.traces.workload import TraceRequest, Workload, hashed_blocks, scale_len

CC_BLOCK = 64
MAX_CALLS = 100_000  # calls in one trace (the published ones hold up to 13.7K)


class CcCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    t: Seconds
    model: str = Field(default="", max_length=64)
    in_: Tokens = Field(alias="in")
    out: Tokens
    hash_ids: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)
    api_time: Seconds | None = None


class CcTrace(BaseModel):
    model_config = ConfigDict(extra="ignore")

    requests: list[CcCall] = Field(min_length=1, max_length=MAX_CALLS)
    hash_id_scope: Literal["local", "global"] = "local"


def load_cc_traces(path: Path, token_scale: int = 1) -> Workload:
    block = max(1, CC_BLOCK // token_scale)
    calls: list[tuple[float, int, int, CcCall, str]] = []  # (t, line, index, call, hash namespace)
    for i, obj in json_lines(path):
        tr: CcTrace = parse_line(CcTrace, path, i, obj)
        scope = f"{path.name}:{i}" if tr.hash_id_scope == "local" else path.name
        for k, c in enumerate(tr.requests):
            n = len(c.hash_ids)
            if n * CC_BLOCK < c.in_ or (n - 1) * CC_BLOCK >= c.in_:
                raise line_error(path, i, f"requests[{k}].hash_ids", f"{n} blocks of {CC_BLOCK} tokens for "
                                                                     f"in {c.in_}")
            if k and c.t < tr.requests[k - 1].t:
                raise line_error(path, i, f"requests[{k}].t", f"goes backwards ({c.t} < {tr.requests[k - 1].t})")
            calls.append((c.t, i, k, c, scope))
    if not calls:
        raise line_error(path, 1, "(file)", "no requests")
    calls.sort(key=lambda x: (x[0], x[1], x[2]))
    t0 = calls[0][0]
    reqs: list[TraceRequest] = []
    for t, i, k, c, scope in calls:
        segs = hashed_blocks(f"cc:{scope}", c.hash_ids, min(scale_len(c.in_, token_scale), len(c.hash_ids) * block),
                             block)
        reqs.append(TraceRequest(f"c{i:05d}.{k:05d}", segs, scale_len(c.out, token_scale), at=t - t0,
                                 session=f"cc{i}", turn=k, line=i, hints=RequestHints(tag=c.model[:32])))
    return Workload(path, "cc-traces", reqs, token_scale, block)
