"""TraceLab traces (University of Washington, 2026: rounds of Claude Code and Codex coding
agents), CSV: a row per LLM round.

Columns read (others ignored): ``session_id``, ``round_idx`` (0, 1, 2, ... within a session,
each after the one before it in the file), ``prefix_len`` (tokens at the head of this
round's prompt that a prefix cache could hold: the session's earlier context),
``input_len`` (the whole prompt), ``output_len``, ``tool_wait_after_ms`` (the tool time
after this round's answer, before the session's next round) and ``arrival_time`` (seconds;
read for a session's first round only).

The prompt, as we build it: a session keeps its context (every earlier round's prompt and
answer, in order); a round's prompt is the first ``prefix_len`` tokens of that context
(at most all of it) followed by ``input_len - prefix_len`` new tokens, and its answer is
added to the context after it. So a round's planned hit, where answers are cached
(``workers.cache_outputs``), is its ``prefix_len`` whenever the context is that long: the
trace's own cached share (a longer one is cut to the context, counted in
``meta.prefix_longer_than_context``); where they are not, the earlier prompts'.

Replay, closed loop as published: a session's first round at its arrival time; each next
round once the previous answer has come back plus the previous round's tool wait.
"""

from __future__ import annotations

from pathlib import Path

from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_SECONDS, MAX_TOKENS, csv_int, csv_rows, csv_seconds
from testbed.traces.workload import Segment, TraceRequest, Workload, cut, scale_len

TRACELAB_COLUMNS = ("session_id", "round_idx", "prefix_len", "input_len", "output_len", "tool_wait_after_ms",
                    "arrival_time")
TRACELAB_BLOCK = 64  # none is published (prefixes are token counts): the planned hit is counted in 64-token blocks


class _Session:
    def __init__(self, rid: str) -> None:
        self.root = rid
        self.last: str = rid
        self.next_round = 0
        self.context: list[Segment] = []
        self.context_len = 0
        self.tool_wait_s = 0.0


def load_tracelab(path: Path, token_scale: int = 1) -> Workload:
    sessions: dict[str, _Session] = {}
    reqs: list[TraceRequest] = []
    t0: float | None = None
    clamped = 0
    for i, row in csv_rows(path, TRACELAB_COLUMNS):
        sid = (row.get("session_id") or "").strip()
        if not sid or len(sid) > 64:
            raise line_error(path, i, "session_id", f"expected 1 to 64 characters, got {sid[:64]!r}")
        rnd = csv_int(path, i, row, "round_idx", 0, 10_000_000)
        prefix = csv_int(path, i, row, "prefix_len", 0, MAX_TOKENS)
        n_in = csv_int(path, i, row, "input_len", 1, MAX_TOKENS)
        n_out = csv_int(path, i, row, "output_len", 1, MAX_TOKENS)
        wait_s = csv_seconds(path, i, row, "tool_wait_after_ms", 1e-3)
        if prefix > n_in:
            raise line_error(path, i, "prefix_len", f"{prefix} is longer than input_len {n_in}")
        rid = f"t{len(reqs):06d}"
        s = sessions.get(sid)
        expected = 0 if s is None else s.next_round
        if rnd != expected:
            raise line_error(path, i, "round_idx", f"session {sid[:64]!r}: expected round {expected}, got {rnd}")
        if s is None:
            at = csv_seconds(path, i, row, "arrival_time")
            t0 = at if t0 is None else min(t0, at)
            s = sessions[sid] = _Session(rid)
        want_prefix = scale_len(prefix, token_scale) if prefix else 0
        have = min(want_prefix, s.context_len)
        clamped += have < want_prefix
        total = scale_len(n_in, token_scale)
        segs = cut(s.context, min(have, total))
        fresh = total - sum(x.n for x in segs)
        if fresh > 0:
            segs.append(Segment(f"tracelab:{path.name}:{i}:in", fresh))
        answer = Segment(f"tracelab:{path.name}:{i}:out", scale_len(n_out, token_scale))
        if s.next_round == 0:
            reqs.append(TraceRequest(rid, segs, answer.n, at=at, session=s.root, turn=rnd, line=i, answer=answer))
        else:
            reqs.append(TraceRequest(rid, segs, answer.n, after=s.last, delay=s.tool_wait_s, session=s.root,
                                     turn=rnd, line=i, answer=answer))
        s.context = [*segs, answer]
        s.context_len = sum(x.n for x in s.context)
        s.last, s.next_round, s.tool_wait_s = rid, rnd + 1, min(wait_s, MAX_SECONDS)
    if not reqs:
        raise line_error(path, 1, "(file)", "no requests")
    for r in reqs:  # first rounds from the earliest arrival
        if r.at is not None:
            r.at -= t0 or 0.0
    meta = {"sessions": len(sessions), "prefix_longer_than_context": clamped}
    return Workload(path, "tracelab", reqs, token_scale, max(1, TRACELAB_BLOCK // token_scale), meta)
