"""Per-request latency metrics and summaries, defined as in vLLM's serving benchmark.

Measured at the client: TTFT = send -> first token received; TPOT = (E2E - TTFT) /
(output tokens - 1), only when output > 1; ITL = every gap between consecutive tokens,
pooled over requests; E2E = send -> last token. Failed requests are counted and listed
with their reasons and excluded from latency statistics; in goodput they count as not
meeting the SLO. Goodput = requests that completed within the SLO (TTFT and TPOT) per
second of the run (first send to last token).

Under an emulation (``testbed/deploy/emulation.py``) every duration is reported in emulated
seconds: measured real time divided by the dilation ``D``; TPOT and ITL per emulated
token (further divided by ``s_out``); output, eager and handoff token counts in emulated
tokens (``x s_out``; ``output_tokens`` stays the replayed count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict

from protocol.messages import Extended, HandoffSent, KvReceived, KvSent, PrefillDone, RequestHints
from protocol.router_config import RequestRecord
from protocol.worker_config import Scales
from testbed.deploy.run_record import ClientRecord
from testbed.traces.workload import RequestSpec


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 5.0
    tpot_s: float = 0.25


def _kept_off(e: KvSent, planned_delta: int | None) -> int:
    """KV bytes a cut-off kept off the line: what the receiver lacked minus what crossed (the
    receiver's TCP acknowledged; bytes still in the sender's socket buffer were discarded by
    the reset). A transfer cut off before the receiver's answer to HELLO (waiting in the
    sender's queue, or with HELLO on the line) never learnt what the receiver lacked, and
    sent none of it: the router's estimate at planning time stands in."""
    if e.planned_payload == 0:
        return planned_delta or 0
    return max(0, e.planned_payload - min(e.payload, e.bytes))


NAN = float("nan")


@dataclass
class RequestRow:
    """One request of one policy's run: a row of ``requests.csv`` (durations in emulated
    seconds, NaN where nothing was measured; token counts as the column names say)."""

    rid: str
    ok: bool
    error: str | None
    pipeline: str | None
    prefill_worker: str | None
    decode_worker: str | None
    prompt_tokens: int
    output_tokens: int  # replayed tokens
    max_new: int
    session: str | None
    turn: int
    short_output: bool
    output_tokens_emulated: int
    sent: float  # the client's clock
    sent_offset_s: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_hit_tokens: int | None
    prefill_computed: int | None
    # The prefix hit, as shares of the prompt: planned (what an unbounded cache of every earlier
    # prompt, and answer where the scenario caches them, would hold: ``planned_hit.planned_hits``) and got
    # (what the prefill that served it held). Apart, they say what routing and cache sizes cost.
    # At the decoders: what the main decoder (and a relay) already held of the prompt when its KV
    # came (the KV that did not cross: PDD's decoder cache, ``KvReceived.had``).
    planned_hit: float
    prefill_hit: float
    decode_hit: float
    relay_hit: float
    kv_bytes: int
    kv_tokens_sent: int
    wan_kv_bytes: int
    wan_kv_cancelled_bytes: int
    wan_kv_in_flight_bytes: int  # cut-off WAN transfers' bytes on the network, unacknowledged
    wan_cut_off: bool
    kv_transfer_s: float
    wan_transfer_s: float
    # When KV was on the WAN and when the main decoder took over (emulated seconds into the
    # run): the report's throughput and load over time are rebuilt from these.
    wan_start_s: float
    wan_end_s: float
    handoff_at_s: float
    kv_queued_s: float
    relay: str | None
    eager_tokens: int  # emulated
    rld_share: float
    handoffs: int
    handoff_sizes: str  # emulated tokens per handoff, "+"-joined
    md_kv_to_handoff_s: float
    handoff_mismatches: int
    md_failed: str | None
    router_error: str | None  # how the router ended it, when it failed there (a client's cancel included)
    attempts: int  # 1 + the failed attempts retried before the last
    retried_errors: str  # why each retried attempt failed, " | "-joined
    plan: dict[str, Any] = field(default_factory=dict)  # the router's routing inputs: plan_* columns

    def columns(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        return out | {f"plan_{k}": v for k, v in self.plan.items()}


def _crossed(rr: RequestRecord, to: str) -> bool:
    """Whether KV sent to ``to`` crossed the WAN: it went to another datacenter than the
    prefill's (a record without its workers' datacenters: only the main decoder's KV could)."""
    if rr.dcs:
        return rr.prefill_dc is not None and rr.dcs.get(to, rr.prefill_dc) != rr.prefill_dc
    return rr.prefill_dc is not None and rr.prefill_dc != rr.decode_dc and to == rr.decode


def request_row(r: ClientRecord, rr: RequestRecord, h: RequestHints, sc: Scales, t0: float,
                planned: float = NAN) -> RequestRow:
    """The row of one request from the client's record and the router's."""
    d, per_token = sc.dilation, sc.dilation * sc.s_out
    kv_sent = [e for e in rr.events if isinstance(e, KvSent)]
    prefill = next((e for e in rr.events if isinstance(e, PrefillDone)), None)
    wan = [e for e in kv_sent if _crossed(rr, e.to)]
    handoffs = [e for e in rr.events if isinstance(e, HandoffSent)]
    final_extend = next((e for e in rr.events if isinstance(e, Extended) and e.final), None)
    relay = rr.relay or (rr.decode if rr.pipeline == "P-RLD" else None)
    eager = r.by_worker.get(relay, 0) if relay else 0
    had = {e.worker: e.had for e in rr.events if isinstance(e, KvReceived)}
    done = r.ok and bool(r.token_times)
    return RequestRow(
        rid=r.rid, ok=r.ok, error=r.error, pipeline=rr.pipeline, prefill_worker=rr.prefill, decode_worker=rr.decode,
        prompt_tokens=r.prompt_len, output_tokens=len(r.tokens), max_new=r.max_new,
        session=h.session, turn=h.turn, short_output=h.short_output,
        output_tokens_emulated=len(r.tokens) * sc.s_out,
        sent=r.sent, sent_offset_s=(r.sent - t0) / d if r.sent else NAN,
        ttft_s=(r.token_times[0] - r.sent) / d if done else NAN,
        tpot_s=((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) / per_token
                if done and len(r.token_times) > 1 else NAN),
        e2e_s=(r.token_times[-1] - r.sent) / d if done else NAN,
        prefill_hit_tokens=prefill.hit_tokens if prefill else None, planned_hit=planned,
        prefill_hit=prefill.hit_tokens / r.prompt_len if prefill and r.prompt_len else NAN,
        decode_hit=had[rr.decode] / r.prompt_len if rr.decode in had and r.prompt_len else NAN,
        relay_hit=had[relay] / r.prompt_len if relay in had and r.prompt_len else NAN,
        prefill_computed=prefill.computed if prefill else None,
        kv_bytes=sum(e.bytes for e in kv_sent), kv_tokens_sent=sum(e.tokens for e in kv_sent),
        wan_kv_bytes=sum(e.bytes for e in wan),
        wan_kv_cancelled_bytes=sum(_kept_off(e, rr.plan_info.delta_bytes) for e in wan if e.cancelled),
        wan_kv_in_flight_bytes=sum(e.in_flight for e in wan if e.cancelled),
        wan_cut_off=any(e.cancelled for e in wan),
        kv_transfer_s=max(e.end - e.start for e in kv_sent) / d if kv_sent else NAN,
        wan_transfer_s=max(e.end - e.start for e in wan) / d if wan else NAN,
        wan_start_s=(min(e.start for e in wan) - t0) / d if wan else NAN,
        wan_end_s=(max(e.end for e in wan) - t0) / d if wan else NAN,
        handoff_at_s=(final_extend.t - t0) / d if final_extend else NAN,
        kv_queued_s=max(e.queued_s for e in kv_sent) / d if kv_sent else NAN,
        relay=relay, eager_tokens=eager * sc.s_out, rld_share=eager / len(r.tokens) if r.tokens else NAN,
        handoffs=len(handoffs), handoff_sizes="+".join(str(e.tokens * sc.s_out) for e in handoffs),
        md_kv_to_handoff_s=final_extend.since_kv_s / d if final_extend else NAN,
        handoff_mismatches=final_extend.mismatches if final_extend else 0, md_failed=rr.md_failed,
        router_error=rr.error, attempts=1 + len(r.retried), retried_errors=" | ".join(a.error for a in r.retried),
        plan=rr.plan_info.model_dump(exclude_none=True),
    )  # fmt: skip


def request_rows(recs: dict[str, ClientRecord], router: dict[str, RequestRecord],
                 specs: list[RequestSpec] | None = None, scales: Scales | None = None,
                 planned: dict[str, float] | None = None) -> pd.DataFrame:
    """Every request's ``RequestRow`` as the run's DataFrame (``requests.csv``/``.parquet``): the
    router's side is its record of the request's last attempt."""
    sc = scales or Scales()
    hints = {s.rid: s.hints for s in specs or []}
    t0 = min((r.sent for r in recs.values() if r.sent), default=0.0)
    planned = planned or {}
    return pd.DataFrame([request_row(r, router.get(r.last_rid) or RequestRecord(rid=r.last_rid),
                                     hints.get(rid) or RequestHints(), sc, t0, planned.get(rid, NAN)).columns()
                         for rid, r in recs.items()])


def itls(recs: dict[str, ClientRecord], scales: Scales | None = None) -> np.ndarray:
    """Every gap between consecutive tokens (per emulated token under an emulation). An
    array: an emulated hour at token scale 1 has 10.8 M of them, 345 MB as a list of floats."""
    sc = scales or Scales()
    per_token = sc.dilation * sc.s_out
    streams = [np.asarray(r.token_times, dtype=float) for r in recs.values() if r.ok and len(r.token_times) > 1]
    out, at = np.empty(sum(len(t) - 1 for t in streams)), 0
    for t in streams:  # written in place: no second copy of 10.8 M gaps at the run's memory peak
        np.subtract(t[1:], t[:-1], out=out[at : at + len(t) - 1])
        at += len(t) - 1
    out /= per_token
    return out


def _pct(s: pd.Series, q: float) -> float | None:
    s = s.dropna()
    return float(np.percentile(s, q)) if len(s) else None


class Summary(BaseModel):
    """One policy's measured summary of a replay (durations in emulated seconds under an
    emulation; ``None`` where nothing was measured)."""

    model_config = ConfigDict(extra="forbid")

    slo: Slo
    slo_met: int
    slo_attainment: float | None
    duration_s: float | None
    goodput_rps: float | None
    requests: int
    completed: int
    failed: int
    failures: dict[str, str | None]
    # Retries (a failed attempt sent again): how many requests needed one, how many attempts
    # failed, their share of all attempts, and the goodput the failures cost: requests that
    # missed the SLO (or failed) after a failed attempt, per second of the run.
    retried: int = 0
    failed_attempts: int = 0
    retry_share: float | None = None
    goodput_lost_rps: float | None = None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    wan_kv_bytes: int
    kv_bytes: int
    wan_kv_cancelled_bytes: int
    # What cut-off transfers had sent onto the network unacknowledged when cut: the most their
    # line can have carried beyond ``wan_kv_bytes`` (None in summaries written before it was kept).
    wan_kv_in_flight_bytes: int | None = None
    wan_cut_offs: int
    wan_transfers: int
    wan_transfer_min_s: float | None
    wan_transfer_p50_s: float | None
    wan_transfer_max_s: float | None
    output_tokens: int
    output_tokens_emulated: int
    pipelines: dict[str, int]
    eager_tokens: int
    handoffs: int
    rld_share: float | None
    relayed: int
    handoff_p50_s: float | None
    handoff_p99_s: float | None
    handoff_mismatches: int
    requests_by_worker: dict[str, int]
    # The prefix hit planned (``planned_hit.planned_hits``) and got at the prefill, over completed requests:
    # mean share of the prompt, and share of requests above 95 % (None: not measured).
    hit_planned_mean: float | None = None
    hit_planned_above95: float | None = None
    hit_got_mean: float | None = None
    hit_got_above95: float | None = None
    hit_decode_mean: float | None = None  # what the main decoder held when the KV came (mean share)
    hit_decode_above95: float | None = None


def summarize(df: pd.DataFrame, itl: Sequence[float] | np.ndarray, slo: Slo | None = None,
              recs: dict[str, ClientRecord] | None = None, scales: Scales | None = None) -> Summary:
    slo = slo or Slo()
    ok = df[df.ok]
    failed = df[~df.ok]
    itl_s = pd.Series(itl, dtype=float)
    met = ok[(ok.ttft_s <= slo.ttft_s) & (ok.tpot_s.fillna(0) <= slo.tpot_s)]
    wan_t = df.wan_transfer_s.dropna()
    span = None
    if recs:
        sends = [r.sent for r in recs.values() if r.sent]
        ends = [r.token_times[-1] for r in recs.values() if r.token_times]
        if sends and ends:
            span = (max(ends) - min(sends)) / (scales or Scales()).dilation
    return Summary(
        slo=slo, slo_met=int(len(met)),
        slo_attainment=len(met) / len(df) if len(df) else None,
        duration_s=span, goodput_rps=len(met) / span if span else None,
        requests=len(df), completed=int(len(ok)), failed=int(len(failed)),
        failures={r.rid: r.error for r in failed.itertuples()},
        retried=int((df.attempts > 1).sum()), failed_attempts=int((df.attempts - 1).sum()),
        retry_share=float((df.attempts - 1).sum() / df.attempts.sum()) if len(df) else None,
        goodput_lost_rps=(int(((df.attempts > 1) | ~df.ok).sum()) - int((met.attempts > 1).sum())) / span
        if span else None,
        ttft_mean_s=float(ok.ttft_s.mean()) if ok.ttft_s.notna().any() else None,
        ttft_p50_s=_pct(ok.ttft_s, 50), ttft_p90_s=_pct(ok.ttft_s, 90), ttft_p99_s=_pct(ok.ttft_s, 99),
        tpot_p50_s=_pct(ok.tpot_s, 50), tpot_p99_s=_pct(ok.tpot_s, 99),
        itl_p50_s=_pct(itl_s, 50), itl_p99_s=_pct(itl_s, 99),
        e2e_p50_s=_pct(ok.e2e_s, 50), e2e_p99_s=_pct(ok.e2e_s, 99),
        wan_kv_bytes=int(df.wan_kv_bytes.sum()), kv_bytes=int(df.kv_bytes.sum()),
        wan_kv_cancelled_bytes=int(df.wan_kv_cancelled_bytes.sum()), wan_cut_offs=int(df.wan_cut_off.sum()),
        wan_kv_in_flight_bytes=int(df.wan_kv_in_flight_bytes.sum()),
        wan_transfers=len(wan_t), wan_transfer_min_s=float(wan_t.min()) if len(wan_t) else None,
        wan_transfer_p50_s=_pct(wan_t, 50), wan_transfer_max_s=float(wan_t.max()) if len(wan_t) else None,
        output_tokens=int(ok.output_tokens.sum()), output_tokens_emulated=int(ok.output_tokens_emulated.sum()),
        pipelines={str(k): int(v) for k, v in df.pipeline.value_counts().items()},
        eager_tokens=int(ok.eager_tokens.sum()), handoffs=int(df.handoffs.sum()),
        rld_share=(float(ok.eager_tokens.sum() / ok.output_tokens_emulated.sum())
                   if ok.output_tokens_emulated.sum() else None),
        relayed=int((df.pipeline == "P-RLD-MD").sum()),
        handoff_p50_s=_pct(ok.md_kv_to_handoff_s, 50), handoff_p99_s=_pct(ok.md_kv_to_handoff_s, 99),
        handoff_mismatches=int(df.handoff_mismatches.sum()),
        requests_by_worker=requests_by_worker(df),
        **_hit_summary(ok),
    )  # fmt: skip


def _hit_summary(ok: pd.DataFrame) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, col in (("planned", "planned_hit"), ("got", "prefill_hit"), ("decode", "decode_hit")):
        v = ok[col].dropna() if col in ok else pd.Series(dtype=float)
        out[f"hit_{key}_mean"] = float(v.mean()) if len(v) else None
        out[f"hit_{key}_above95"] = float((v > 0.95).mean()) if len(v) else None
    return out


def requests_by_worker(df: pd.DataFrame) -> dict[str, int]:
    """How many requests each instance served (prefill, decoder, relay): the balance across
    instances of a role."""
    counts: dict[str, int] = {}
    for row in df[["prefill_worker", "decode_worker", "relay"]].itertuples(index=False):
        for name in {w for w in row if isinstance(w, str)}:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def format_summary(name: str, s: Summary) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    return (
        f"{name:10} {s.completed:>4}/{s.requests:<4} failed {s.failed:<3} "
        f"TTFT ms p50 {ms(s.ttft_p50_s):>6} p90 {ms(s.ttft_p90_s):>6} p99 {ms(s.ttft_p99_s):>6} | "
        f"TPOT ms p50 {ms(s.tpot_p50_s):>5} p99 {ms(s.tpot_p99_s):>5} | "
        f"E2E ms p50 {ms(s.e2e_p50_s):>6} p99 {ms(s.e2e_p99_s):>6} | WAN KV {s.wan_kv_bytes / 1e6:.1f} MB"
        + (f" | SLO met {100 * s.slo_attainment:.0f}%" if s.slo_attainment is not None else "")
        + (f" | retried {s.retried} ({s.failed_attempts} failed attempts)" if s.failed_attempts else "")
    )
