"""``testbed whatif``: does decode in another datacenter still hurt with a 2026 model?

The gap that cross-datacenter decode adds (cross-dc minus same-dc TTFT P50) and what PDD
and prefill offload do about it, per model card (``topologies/models/``) and line rate, on
one scenario and trace. By default the scenario's model keeps its compute and each card
brings only what crosses the line, its KV bytes per token and fixed-size state
(``Emulation.kv_of``): one variable moves (``--whole-cards``: each card as the emulated
model, compute included, which also moves every worker's load). The rows run in the
simulator side by side (``parallel.run_all``).

Saved: ``whatif.json`` (``WhatIfResult``), ``whatif.md``, ``gap_vs_kv.png``; each row's run
folder under ``<out>/<card>-<rate>g/``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from testbed.analysis.results import RunSummary, load_run
from testbed.analysis.tables import table_head
from testbed.errors import InputError
from testbed.experiments.parallel import Replay, run_all
from testbed.experiments.sensitivity import with_wan
from testbed.experiments.trace_run import RunOptions
from testbed.hardware import ModelCard
from testbed.outputs import write_atomic
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.traces.workload import Workload


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid")

    card: str
    rate_gbit: float
    kv_bytes_per_token: int  # emulated, the card's full-attention layers
    state_mb: float  # a request's fixed-size state
    run_dir: str
    gap_p50_s: float | None  # cross-dc minus same-dc TTFT P50
    cross_p99_s: float | None
    p99_s: dict[str, float]  # TTFT P99 of every policy but cross-dc
    wan_kv_gb: dict[str, float]  # by policy
    request_mb: float | None  # cross-dc's WAN KV per completed request: what a request puts on the line


class WhatIfResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: str
    trace: str
    requests: int
    compute_of: str | None  # the scenario's model whose compute every card kept; None: whole cards
    rows: list[Row]


def with_card(sc: Scenario, name: str, card: ModelCard, whole: bool) -> Scenario:
    """``sc`` with ``card`` (under ``name``): as the line's KV alone (``Emulation.kv_of``: the
    scenario's model keeps its compute), or, when ``whole``, as the emulated model."""
    if sc.emulation is None:
        raise InputError(f"{sc.source}: no emulation section: no model card to replace")
    if sc.models.get(name, card) != card:  # the scenario's own model of that name stays as it is
        name = f"{name}-card"
    key = "model" if whole else "kv_of"
    return sc.model_copy(update={"models": {**sc.models, name: card},
                                 "emulation": sc.emulation.model_copy(update={key: name})})


def model_whatif(sc: Scenario, wl: Workload, cards: dict[str, ModelCard], rates_gbit: list[float],
                 opts: RunOptions, out: Path, policies: list[PolicySpec], whole: bool = False) -> WhatIfResult:
    labels = {p.label.split(":")[0] for p in policies}
    if not {"same-dc", "cross-dc"} <= labels:
        raise InputError("--policies: the gap needs same-dc and cross-dc")
    if not rates_gbit or min(rates_gbit) <= 0:
        raise InputError(f"--rates: positive Gbit/s, got {rates_gbit}")
    out.mkdir(parents=True, exist_ok=True)
    replays, rows = [], []
    for name, card in cards.items():
        sc_c = with_card(sc, name, card, whole)
        for rate in rates_gbit:
            folder = out / f"{name}-{rate:g}g"
            print(f"\n== whatif {name} at {rate:g} Gbit/s -> {folder}", flush=True)
            replays.append(Replay(with_wan(sc_c, rate * 1000, None), wl, policies,
                                  dataclasses.replace(opts, out=folder, allow_infidelity=True)))
            rows.append((name, rate, sc_c.models[name], folder))
    run_all(replays)
    result = WhatIfResult(scenario=str(sc.source), trace=str(wl.source), requests=len(wl.requests),
                          compute_of=None if whole else sc.emulation.model if sc.emulation else None,
                          rows=[_row(n, r, c, f, load_run(f)[0]) for n, r, c, f in rows])
    save(result, out)
    return result


def _row(name: str, rate: float, card: ModelCard, folder: Path, s: RunSummary) -> Row:
    by = {k.split(":")[0]: v for k, v in s.policies.items()}
    same, cross = by["same-dc"].ttft_p50_s, by["cross-dc"].ttft_p50_s
    return Row(card=name, rate_gbit=rate, kv_bytes_per_token=card.kv_bytes_per_token,
               state_mb=card.state_bytes / 1e6, run_dir=str(folder),
               gap_p50_s=None if same is None or cross is None else cross - same,
               cross_p99_s=by["cross-dc"].ttft_p99_s,
               p99_s={k: v.ttft_p99_s for k, v in by.items() if k != "cross-dc" and v.ttft_p99_s is not None},
               wan_kv_gb={k: v.wan_gb for k, v in by.items()},
               request_mb=by["cross-dc"].wan_gb * 1e3 / by["cross-dc"].completed if by["cross-dc"].completed else None)


def save(r: WhatIfResult, out: Path) -> None:
    from testbed.analysis.plots import plot_gap_vs_kv  # matplotlib

    write_atomic(out / "whatif.json", r.model_dump_json(indent=2))
    write_atomic(out / "whatif.md", markdown(r))
    plot_gap_vs_kv([(row.card, row.rate_gbit, request_mb(r, row.card), row.gap_p50_s) for row in r.rows],
                   out / "gap_vs_kv.png")


def request_mb(r: WhatIfResult, card: str) -> float | None:
    """A card's bytes per request on the line, from its fastest line's cross-dc run (where
    the fewest transfers were cut off by their deadline)."""
    rows = [row for row in r.rows if row.card == card and row.request_mb is not None]
    return max(rows, key=lambda row: row.rate_gbit).request_mb if rows else None


def _s(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}"


def markdown(r: WhatIfResult) -> str:
    others = sorted({k for row in r.rows for k in row.p99_s})
    weights = (f"{r.compute_of}'s compute with each card's KV and state on the line" if r.compute_of
               else "each card whole (compute and KV)")
    lines = [f"# Cross-datacenter decode per model and line ({r.requests} requests per policy, the simulator)", "",
             f"Scenario `{r.scenario}`, trace `{r.trace}`, {weights}. Times in emulated seconds; MB per "
             "request: cross-dc's KV and state on the line per completed request, at the card's fastest line.", "",
             *table_head(["model", "line Gbit/s", "KV B/token", "state MB", "gap P50 s", "cross-dc P99 s",
                          *[f"{p} P99 s" for p in others], "cross-dc WAN KV GB", "MB per request"],
                         "l" + "r" * (7 + len(others)))]
    for row in r.rows:
        cells = [_s(row.p99_s.get(p)) for p in others]
        lines.append(f"| {row.card} | {row.rate_gbit:g} | {row.kv_bytes_per_token:,} | {row.state_mb:.1f} | "
                     f"{_s(row.gap_p50_s)} | {_s(row.cross_p99_s)} | {' | '.join(cells)} | "
                     f"{row.wan_kv_gb.get('cross-dc', 0.0):.1f} | {_s(request_mb(r, row.card))} |")
    return "\n".join(lines) + "\n"
