"""BurstGPT traces (ChatGPT and GPT-4 usage on Azure OpenAI, published 2024-2025), CSV: a row
per request, open loop.

Columns read (others ignored): ``Timestamp`` (seconds from the trace's start), ``Model``
(kept as the request's tag), ``Request tokens``, ``Response tokens``. No prefixes are
published, so every prompt is its own (nothing is shared: a planned hit of 0). A row whose
response has 0 tokens is a request that failed in the trace: it is left out and counted
(``meta.failed_in_trace``), since a replay cannot ask for an answer of 0 tokens.
"""

from __future__ import annotations

from pathlib import Path

from protocol.messages import RequestHints
from testbed.traces.line_errors import line_error
from testbed.traces.lines import MAX_TOKENS, csv_int, csv_rows, csv_seconds
from testbed.traces.workload import Segment, TraceRequest, Workload, scale_len

BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
BURSTGPT_BLOCK = 512  # nothing is shared; the block only sizes the hit statistics


def load_burstgpt(path: Path, token_scale: int = 1) -> Workload:
    reqs: list[TraceRequest] = []
    t0: float | None = None
    last = 0.0
    failed = 0
    for i, row in csv_rows(path, BURSTGPT_COLUMNS):
        t = csv_seconds(path, i, row, "Timestamp")
        if t < last:
            raise line_error(path, i, "Timestamp", f"goes backwards ({t} < {last})")
        last = t
        n_in = csv_int(path, i, row, "Request tokens", 1, MAX_TOKENS)
        n_out = csv_int(path, i, row, "Response tokens", 0, MAX_TOKENS)
        model = (row.get("Model") or "").strip()
        if len(model) > 32:
            raise line_error(path, i, "Model", f"longer than 32 characters: {model[:40]!r}")
        if n_out == 0:
            failed += 1
            continue
        t0 = t if t0 is None else t0
        reqs.append(TraceRequest(f"g{i:07d}", [Segment(f"burstgpt:{path.name}:{i}", scale_len(n_in, token_scale))],
                                 scale_len(n_out, token_scale), at=t - t0, line=i, hints=RequestHints(tag=model)))
    if not reqs:
        raise line_error(path, 1, "(file)", "no requests" + (f" ({failed} failed in the trace)" if failed else ""))
    return Workload(path, "burstgpt", reqs, token_scale, max(1, BURSTGPT_BLOCK // token_scale),
                    {"failed_in_trace": failed})
