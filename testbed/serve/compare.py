"""An external client's measurement beside the server's own records of the same requests.

The client (aiperf) measures in real seconds at its end of an HTTP connection: TTFT from
sending the request to the first streamed token, inter-token latency per token it
received. The server's records (``testbed serve``'s run directory) are in emulated
seconds, taken where the front end sits; ``x dilation`` gives real seconds, and the
server's TPOT (per emulated token) ``x dilation x token scale`` is per real token, which is
what the client calls inter-token latency. The two then differ only by what lies between
them: the client's own overhead, the HTTP request and its parsing and tokenisation, and
the server-sent events back over the machine's loopback.

Requests are also matched one to one (the client's start time to the server's receipt of
the same request, nearest within ``MATCH_S``), so the difference is given per request too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.analysis.results import load_run, write_csv
from testbed.analysis.tables import table_head
from testbed.errors import InputError
from testbed.outputs import write_atomic

UNIX_MINUS_STAMP = "unix_minus_stamp_s"  # in a served run's trace meta: unix time = a record's stamp + this
MATCH_S = 1.0  # a client's request start and the server's receipt of it, at most this far apart
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class ClientRecords:
    """Per request: when it started (unix s), TTFT and inter-token latency (real s), tokens."""

    frame: pd.DataFrame  # start, ttft_s, itl_s, output_tokens
    tool: str


def _value(metrics: dict, name: str, scale: float = 1e-3) -> float:
    """An aiperf metric's value (milliseconds -> seconds by default); NaN when absent."""
    v = (metrics.get(name) or {}).get("value")
    return float(v) * scale if isinstance(v, (int, float)) else np.nan


def load_aiperf(artifact_dir: Path) -> ClientRecords:
    """aiperf's per-request export (``profile_export.jsonl``)."""
    path = artifact_dir / "profile_export.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: no aiperf per-request export (was aiperf run with --artifact-dir {artifact_dir}?)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
            meta, m = rec["metadata"], rec.get("metrics") or {}
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{n}: not an aiperf record ({e})") from e
        if meta.get("benchmark_phase") not in (None, "profiling") or "time_to_first_token" not in m:
            continue  # warm-up, or a request that failed (no first token)

        rows.append({"start": meta["request_start_ns"] / 1e9, "ttft_s": _value(m, "time_to_first_token"),
                     "itl_s": _value(m, "inter_token_latency"),
                     "output_tokens": _value(m, "output_sequence_length", 1)})
    if not rows:
        raise InputError(f"{path}: no completed request in the export")
    return ClientRecords(pd.DataFrame(rows).sort_values("start", ignore_index=True), "aiperf")


def server_view(run_dir: Path) -> tuple[pd.DataFrame, float, int]:
    """The served run's completed requests in real seconds: start, ttft_s, itl_s (per real
    token); with the dilation and token scale used."""
    summary, df = load_run(run_dir)
    d, s = summary.emulation.dilation, summary.emulation.s_out
    ok = df[df.ok].copy()
    to_unix = summary.trace.meta.get(UNIX_MINUS_STAMP, 0.0)  # absent: a run saved when stamps were unix time
    if not isinstance(to_unix, (int, float)) or not math.isfinite(to_unix):
        raise InputError(f"{run_dir}: summary.json: trace.meta.{UNIX_MINUS_STAMP}: not a number of seconds")
    out = pd.DataFrame({"start": ok.sent + to_unix, "ttft_s": ok.ttft_s * d, "itl_s": ok.tpot_s * d * s,
                        "output_tokens": ok.output_tokens})
    return out.sort_values("start", ignore_index=True), d, s


def match(client: pd.DataFrame, server: pd.DataFrame) -> pd.DataFrame:
    """Each client request with the server's record of it (nearest receipt after its start)."""
    pairs = pd.merge_asof(client, server, on="start", direction="forward", tolerance=MATCH_S,
                          suffixes=("_client", "_server"))
    return pairs.dropna(subset=["ttft_s_server"])


def comparison(client: ClientRecords, server: pd.DataFrame, d: float, s: int) -> tuple[str, pd.DataFrame]:
    """The markdown table (client vs server, real ms, per percentile) and the matched pairs;
    ``server`` as ``server_view`` gives it (real seconds), ``d`` and ``s`` its dilation and
    token scale."""
    c = client.frame
    pairs = match(c, server)
    lines = [
        f"{client.tool}: {len(c)} requests completed; server: {len(server)}; matched {len(pairs)} one to one "
        f"(dilation {d:g}, token scale {s}: real ms = emulated ms x {d:g}; per real token = per emulated "
        f"token x {d * s:g})",
        "",
        *table_head(["metric (real ms)", client.tool, "server", "difference", "matched requests: median difference"]),
    ]
    for col, name in (("ttft_s", "TTFT"), ("itl_s", "TPOT / inter-token latency")):
        diff = (pairs[f"{col}_client"] - pairs[f"{col}_server"]).median() * 1000 if len(pairs) else np.nan
        for q in QUANTILES:
            a, b = c[col].quantile(q) * 1000, server[col].quantile(q) * 1000
            lines.append(f"| {name} P{round(q * 100)} | {a:.1f} | {b:.1f} | {a - b:+.1f} ({(a - b) / b:+.1%}) | "
                         f"{diff:+.1f} |")
    lines += ["", f"Emulated (server, ms): TTFT P50 {server.ttft_s.quantile(0.5) * 1000 / d:.1f}, "
              f"P99 {server.ttft_s.quantile(0.99) * 1000 / d:.1f}; TPOT P50 "
              f"{server.itl_s.quantile(0.5) * 1000 / (d * s):.2f} per emulated token."]
    return "\n".join(lines), pairs


def write_comparison(client: ClientRecords, run_dir: Path, out: Path) -> Path:
    text, pairs = comparison(client, *server_view(run_dir))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(pairs, out / "client_vs_server.csv")
    write_atomic(out / "client_vs_server.md", text + "\n")
    return out / "client_vs_server.md"
