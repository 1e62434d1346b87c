"""Qwen-Bailian traces (Alibaba's, published with "KVCache Cache in the Wild", ATC'25): one
JSON object per line, a request each, in arrival order.

Fields read (others ignored): ``chat_id``, ``parent_chat_id`` (the request this one follows
in its conversation tree; -1 or absent for a root), ``timestamp`` (seconds), ``input_length``,
``output_length``, ``type`` (text, search, image, file: kept as the request's tag), ``turn``
and ``hash_ids``: the prompt's blocks of **16** tokens, each id naming a block's content
(equal ids: equal content, so prefixes shared across requests and turns are cached as
published). The prompt is those blocks, the last cut to ``input_length``.

Replay: a root is sent at its recorded time (open loop); a request with a parent is sent once
its parent's answer has come back and not before its own recorded time (the tree is replayed
in dependency order; a parent that failed leaves its subtree unsent, as an agent would).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from protocol.messages import RequestHints
from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_TOKENS, Seconds, Tokens, json_lines, parse_line
from testbed.traces.workload import TraceRequest, Workload, hashed_blocks, scale_len

BAILIAN_BLOCK = 16
ChatId = StrictInt | StrictStr


class BailianLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    chat_id: ChatId
    parent_chat_id: ChatId | None = None
    timestamp: Seconds
    input_length: Tokens
    output_length: Tokens
    type: str = Field(default="text", max_length=32)
    turn: StrictInt = Field(default=0, ge=0, le=1_000_000)
    hash_ids: list[StrictInt] = Field(min_length=1, max_length=MAX_TOKENS)


def load_bailian(path: Path, token_scale: int = 1) -> Workload:
    block = max(1, BAILIAN_BLOCK // token_scale)
    reqs: list[TraceRequest] = []
    rid_of: dict[str, str] = {}  # chat id -> request id
    root_of: dict[str, str] = {}  # chat id -> its tree's root (the session)
    t0: float | None = None
    last = 0.0
    for i, obj in json_lines(path):
        r: BailianLine = parse_line(BailianLine, path, i, obj)
        chat = str(r.chat_id)
        if len(chat) > 64 or chat in rid_of:
            raise line_error(path, i, "chat_id", f"{chat[:64]!r} " + ("seen before" if chat in rid_of
                                                                      else "longer than 64 characters"))
        n = len(r.hash_ids)
        if n * BAILIAN_BLOCK < r.input_length or (n - 1) * BAILIAN_BLOCK >= r.input_length:
            raise line_error(path, i, "hash_ids", f"{n} blocks of {BAILIAN_BLOCK} tokens for input_length "
                                                  f"{r.input_length}")
        if r.timestamp < last:
            raise line_error(path, i, "timestamp", f"goes backwards ({r.timestamp} < {last})")
        last = r.timestamp
        t0 = r.timestamp if t0 is None else t0
        parent = None if r.parent_chat_id in (None, -1, "-1", "") else str(r.parent_chat_id)
        if parent is not None and parent not in rid_of:
            raise line_error(path, i, "parent_chat_id", f"{parent[:64]!r} is no request before this line")
        rid = f"b{len(reqs):06d}"
        rid_of[chat] = rid
        root_of[chat] = root_of[parent] if parent is not None else rid
        segs = hashed_blocks("bailian", r.hash_ids, min(scale_len(r.input_length, token_scale), n * block), block)
        reqs.append(TraceRequest(rid, segs, scale_len(r.output_length, token_scale), at=r.timestamp - t0,
                                 after=rid_of[parent] if parent is not None else None, session=root_of[chat],
                                 turn=r.turn, line=i, hints=RequestHints(tag=r.type[:32])))
    if not reqs:
        raise line_error(path, 1, "(file)", "no requests")
    return Workload(path, "bailian", reqs, token_scale, block)
