"""Results of a replay: saved (``testbed.analysis.results``), then reported from what was saved.

``save`` writes the request rows and the ``RunSummary``; ``render`` builds everything a
person reads from those two files alone, so ``testbed report RUN_DIR`` (``rebuild``)
regenerates exactly what the run printed, without re-running anything:

* ``report.md``: trace, scenario and emulation; the side-by-side tables; the report's
  figures (``docs/design.md``) beside this run's; every policy's fidelity verdict;
* the plots (``testbed/analysis/plots.py``): ``latency.png``, ``ttft_by_hit.png`` (TTFT per
  prefix-hit bucket: the tail is the low-hit one), ``timeline.png`` (KV on the WAN and
  per-worker decode load over time), ``hit_rates.png``.

Several runs of one setup are tabulated as means with 95 % confidence intervals
(``repetitions_markdown``, ``testbed report A B C --out DIR``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis import plots
from testbed.analysis.confidence import mean_ci
from testbed.analysis.fault_report import fault_table
from testbed.analysis.metrics import Summary
from testbed.analysis.results import REQUESTS_FILE, SUMMARY_FILE, RunSummary, load_run
from testbed.analysis.tables import markdown_table, table_head, table_row
from testbed.analysis.wan_line import byte_factor, line_section
from testbed.deploy.fidelity import format_verdict
from testbed.errors import InputError
from testbed.faults.wan_trace import rate_history
from testbed.outputs import atomic_path, write_atomic
from testbed.traces.generate import same_recipe

# Columns of the side-by-side table: (summary key, header, scale, format).
TABLE_COLUMNS: list[tuple[str, str, float, str]] = [
    ("completed", "done", 1, "{:.0f}"), ("failed", "failed", 1, "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 ms", 1000, "{:.0f}"), ("ttft_p90_s", "p90", 1000, "{:.0f}"),
    ("ttft_p99_s", "p99", 1000, "{:.0f}"), ("tpot_p50_s", "TPOT p50 ms", 1000, "{:.0f}"),
    ("tpot_p99_s", "p99", 1000, "{:.0f}"), ("e2e_p50_s", "E2E p50 ms", 1000, "{:.0f}"),
    ("e2e_p99_s", "p99", 1000, "{:.0f}"), ("wan_kv_bytes", "WAN KV MB", 1e-6, "{:.1f}"),
    ("slo_attainment", "SLO met %", 100, "{:.0f}"), ("goodput_rps", "goodput rps", 1, "{:.2f}"),
]  # fmt: skip


# Second table: how requests were routed and handed over (PDD; zeros for classic policies).
PDD_COLUMNS: list[tuple[str, str, float, str]] = [
    ("relayed", "P-RLD-MD", 1, "{:.0f}"), ("eager_tokens", "eager tok", 1, "{:.0f}"),
    ("handoffs", "handoffs", 1, "{:.0f}"), ("rld_share", "RLD share %", 100, "{:.1f}"),
    ("handoff_p50_s", "KV->handoff p50 ms", 1000, "{:.0f}"), ("wan_cut_offs", "cut-offs", 1, "{:.0f}"),
    ("wan_kv_cancelled_bytes", "WAN MB saved", 1e-6, "{:.1f}"), ("handoff_mismatches", "mismatches", 1, "{:.0f}"),
]  # fmt: skip


def comparison_table(summaries: dict[str, Summary], columns: list[tuple[str, str, float, str]] | None = None) -> str:
    cols = columns or TABLE_COLUMNS
    header = ["policy"] + [c[1] for c in cols]
    rows = []
    for name, s in summaries.items():
        cells = [name]
        for key, _, scale, fmt in cols:
            v = getattr(s, key)
            cells.append("-" if v is None else fmt.format(v * scale))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    lines.append("-" * len(lines[0]))
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def _first(summary: RunSummary, name: str) -> Summary | None:
    """The first policy run under this name (whatever its options)."""
    return next((s for label, s in summary.policies.items() if label.split(":")[0] == name), None)


def _change(new: float | None, old: float | None) -> str:
    return "-" if new is None or old is None or old == 0 else f"{100 * (new - old) / old:+.1f} %"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _get(s: Summary | None, key: str) -> float | None:
    return None if s is None else getattr(s, key)


def paper_comparison(summary: RunSummary, headline: bool = False) -> str:
    """The report's figures (``docs/design.md``) beside this run's, as a markdown table.
    Rows whose policies were not run show "-". ``headline``: only the rows a terminal run
    prints (the latency gap and tail, PDD's P99 and mean, the relay's share)."""
    same, cross, pdd = _first(summary, "same-dc"), _first(summary, "cross-dc"), _first(summary, "pdd")
    p50_gap = None
    if same is not None and cross is not None and same.ttft_p50_s is not None and cross.ttft_p50_s is not None:
        p50_gap = cross.ttft_p50_s - same.ttft_p50_s
    transfer = "-"
    if cross is not None and cross.wan_transfer_min_s is not None and cross.wan_transfer_max_s is not None:
        transfer = (f"{cross.wan_transfer_min_s:.2f}-{cross.wan_transfer_max_s:.2f} s "
                    f"(P50 {_s(cross.wan_transfer_p50_s)}, n={cross.wan_transfers})")
    rows: list[tuple[str, str, str]] = [
        ("same-dc TTFT P50", "4.2 s", _s(_get(same, "ttft_p50_s"))),
        ("cross-dc TTFT P50", "6.7 s", _s(_get(cross, "ttft_p50_s"))),
        ("cross-dc minus same-dc TTFT P50", "+2.5 s", "-" if p50_gap is None else f"{p50_gap:+.2f} s"),
        ("cross-dc TTFT P90", "18.3 s", _s(_get(cross, "ttft_p90_s"))),
        ("cross-dc TTFT P99", "29.7 s", _s(_get(cross, "ttft_p99_s"))),
        ("cross-dc WAN KV transfer time (min-max)", "1-20 s", transfer),
    ]
    for q in ("p50", "p90", "p99", "mean"):
        key, shown = f"ttft_{q}_s", q.upper() if q != "mean" else "mean"
        # The report states -51.5 % over its same-datacenter baseline, without a percentile.
        for base_name, base, said in (("same-dc", same, "-51.5 % (percentile not stated)"),
                                      ("cross-dc", cross, "not stated")):
            if headline and (q, base_name) not in (("mean", "same-dc"), ("p99", "cross-dc")):
                continue
            rows.append((f"PDD TTFT {shown} vs {base_name}", said, _change(_get(pdd, key), _get(base, key))))
    rld = _get(pdd, "rld_share")
    rows.append(("RLD share of output tokens (PDD)", "6.2 %", "-" if rld is None else f"{100 * rld:.1f} %"))
    lines = markdown_table(["figure", "report", "this run"], rows, "lrr")
    return "\n".join(lines)


def cost_table(summary: RunSummary) -> str | None:
    """Each policy's deployment, its price and its cost per output token beside the
    report's cost table; ``None`` when the scenario states no prices."""
    priced = {name: s for name, s in summary.policies.items() if s.cost is not None}
    if not priced:
        return None
    base = _first(summary, "same-dc")
    base_cost = base.cost.total if base is not None and base.cost is not None else None
    unit = next(iter(priced.values())).cost.unit  # type: ignore[union-attr]
    lines = table_head(["policy", "deploys", f"price ({unit})", "vs same-dc", "per 1M output tokens",
                        "WAN GB", "egress", "per 1M with egress", "goodput rps per price"], "llrrrrrrr")

    def num(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else f"{v:{spec}}"

    for name, s in priced.items():
        c = s.cost
        assert c is not None
        per_price = f"{s.goodput_rps / c.total:.4f}" if s.goodput_rps is not None and c.total else "-"
        lines.append(f"| {name} | {c.describe()} | {c.total:.2f} | {_change(c.total, base_cost)} | "
                     f"{num(s.cost_per_mtok)} | {s.wan_gb:.3f} | {num(s.egress, '.4f')} | "
                     f"{num(s.cost_per_mtok_with_egress)} | {per_price} |")
    lines += [
        "",
        "The report: 88 GPU-A (same-datacenter baseline) against 43 GPU-A + 32 GPU-B + one line (PDD); with "
        "GPU-B 20-30 % dearer than GPU-A the total is 3.5-7.1 % lower, per-token cost -37.5 %, BCR (SLA "
        "throughput per hardware cost) up to +37.5 %. Goodput per price above is at this run's load; the "
        "report's BCR uses SLA throughput (the highest load meeting the objectives), which a single run does "
        "not measure.",
    ]
    return "\n".join(lines)


def hit_section(summary: RunSummary) -> list[str]:
    """The prefix hit each policy's requests could have had (planned: an unbounded cache of
    everything sent before them) beside what their prefill held (got); nothing for a summary
    saved before both were kept."""
    rows = [(name, f"{100 * s.hit_planned_mean:.1f} %", f"{100 * (s.hit_planned_above95 or 0):.1f} %",
             f"{100 * s.hit_got_mean:.1f} %", f"{100 * (s.hit_got_above95 or 0):.1f} %",
             "-" if s.hit_decode_mean is None else f"{100 * s.hit_decode_mean:.1f} %")
            for name, s in summary.policies.items()
            if s.hit_planned_mean is not None and s.hit_got_mean is not None]
    if not rows:
        return []
    return ["## Prefix hit: planned and got", "",
            "Completed requests; planned: the share of each prompt an unbounded prefix cache of everything sent "
            "before it would hold (answers too where the scenario caches them), got: what the prefill that served "
            "it held (its cache's size, and the routing across instances, make the difference); main decoder: "
            "what the decoder that streamed to the end already held when the KV came (what did not cross).", "",
            *markdown_table(["policy", "planned mean", "planned above 95 %", "got mean", "got above 95 %",
                             "main decoder held, mean"], rows, "lrrrrr"), ""]


def report_markdown(summary: RunSummary) -> str:
    """``report.md`` of a run: everything in it comes from ``summary.json``."""
    t, e = summary.trace, summary.emulation
    run_of = f"speed {summary.speed:g}" + (f", window {summary.window}" if summary.window else "")
    run_of += f", limit {summary.limit}" if summary.limit else ""
    emulation = (f"model {e.model}, s_in = s_out = {e.s_in}, D = {e.dilation:g} ({e.dilation_reason})"
                 if e.emulating else f"none ({e.dilation_reason})")
    out = [
        f"# Run report: {summary.scenario.name} on {Path(t.trace).name}",
        "",
        f"- trace `{t.trace}` ({t.format}): {t.requests} requests, token scale {t.token_scale}, {run_of}",
        f"- policies: {', '.join(summary.policies)}",
        f"- emulation: {emulation}",
        f"- WAN impairment: {', '.join(sorted({s.impairment for s in summary.policies.values()})) or '-'}",
        f"- times in {summary.units}",
        "",
        "## Side by side",
        "",
        "```",
        comparison_table(dict(summary.policies)),
        "",
        comparison_table(dict(summary.policies), PDD_COLUMNS),
        "```",
        "",
        *hit_section(summary),
        "## The report's figures beside this run's",
        "",
        "The report's figures come from its own setup (64K-token contexts, 1K-token outputs, ~90 % prefix hit, "
        "88 GPUs at an unstated load); this run is comparable with them only as far as it used that setup.",
        "",
        paper_comparison(summary),
        "",
        *(["## Hardware cost", "", costs, ""] if (costs := cost_table(summary)) else []),
        *(["## Faults", "", faults, ""] if (faults := fault_table(summary)) else []),
        "## Fidelity",
        "",
        "```",
        "\n".join(format_verdict(name, s.fidelity, summary.engine) for name, s in summary.policies.items()),
        "```",
        "",
        *line_section(summary),
        "## Plots",
        "",
        "![latency](latency.png)",
        "",
        "![TTFT by prefix hit](ttft_by_hit.png)",
        "",
        "![timeline](timeline.png)",
        "",
    ]
    return "\n".join(out)


def save(out: Path, frames: dict[str, pd.DataFrame], summary: RunSummary) -> list[Path]:
    """Write the request rows and the summary, then render the report from those files."""
    return [*save_data(out, frames, summary), *rebuild(out)]


def save_data(out: Path, frames: dict[str, pd.DataFrame], summary: RunSummary) -> list[Path]:
    """The request rows and the summary alone: what ``rebuild`` renders a report from."""
    out.mkdir(parents=True, exist_ok=True)
    df = pd.concat([f.assign(policy=name) for name, f in frames.items()], ignore_index=True)
    df = df[["policy"] + [c for c in df.columns if c != "policy"]]
    with atomic_path(out / "requests.csv") as tmp:
        df.to_csv(tmp, index=False)
    with atomic_path(out / REQUESTS_FILE) as tmp:
        df.to_parquet(tmp, index=False)
    write_atomic(out / SUMMARY_FILE, summary.model_dump_json(indent=2))
    return [out / "requests.csv", out / REQUESTS_FILE, out / SUMMARY_FILE]


def merge_runs(run_dirs: list[Path], out: Path) -> list[Path]:
    """One run folder holding the policies of several runs of the same trace and emulation
    (a calibration reuses the baselines it already ran at the load it settled on)."""
    runs = [load_run(d) for d in run_dirs]
    first = runs[0][0]
    for d, (s, _) in zip(run_dirs[1:], runs[1:], strict=True):
        if (s.trace, s.speed, s.emulation) != (first.trace, first.speed, first.emulation):
            raise InputError(f"{d}: not the same trace, load and emulation as {run_dirs[0]}")
    summary = first.model_copy(update={
        "policies": {k: v for s, _ in runs for k, v in s.policies.items()},
        "workers": {k: v for s, _ in runs for k, v in s.workers.items()},
    })
    frames = {str(name): g.drop(columns="policy") for _, df in runs for name, g in df.groupby("policy", sort=False)}
    return save(out, frames, summary)


def rebuild(run_dir: Path) -> list[Path]:
    """``testbed report RUN_DIR``: the report and plots of a saved run, from its files alone."""
    summary, df = load_run(run_dir)
    return render(run_dir, summary, df)


def render(out: Path, summary: RunSummary, df: pd.DataFrame) -> list[Path]:
    paths = [out / "report.md", out / "latency.png", out / "ttft_by_hit.png", out / "timeline.png"]
    write_atomic(paths[0], report_markdown(summary))
    plots.plot(df, paths[1])
    plots.plot_ttft_by_hit(df, paths[2])
    # KV bytes in the rows and the line's counters are the real model's (wan_line.byte_factor).
    rates = {name: rate_history(summary.scenario.wan_directions(), s.faults) for name, s in summary.policies.items()}
    plots.plot_timeline(df, paths[3], byte_factor(summary), rates=rates,
                        lines={name: s.wan_line for name, s in summary.policies.items()})
    if plots.plot_hit_rates(summary.workers, out / "hit_rates.png"):
        paths.append(out / "hit_rates.png")
    return paths


# ----------------------------------------------------------------- repetitions of one setup
REPEAT_COLUMNS: list[tuple[str, str, float, str]] = [
    ("ttft_p50_s", "TTFT p50 ms", 1000, "{:.0f}"), ("ttft_p90_s", "p90", 1000, "{:.0f}"),
    ("ttft_p99_s", "p99", 1000, "{:.0f}"), ("tpot_p50_s", "TPOT p50 ms", 1000, "{:.1f}"),
    ("e2e_p50_s", "E2E p50 ms", 1000, "{:.0f}"), ("slo_attainment", "SLO met %", 100, "{:.1f}"),
    ("goodput_rps", "goodput rps", 1, "{:.3f}"), ("wan_kv_bytes", "WAN KV MB", 1e-6, "{:.1f}"),
    ("rld_share", "RLD share %", 100, "{:.1f}"),
]  # fmt: skip


def _same_setup(runs: list[tuple[Path, RunSummary]]) -> None:
    first_dir, first = runs[0]
    for d, s in runs[1:]:
        # Draws of one generated recipe (``--seeds``) are repetitions too, of different files.
        trace = s.trace.trace if same_recipe(first.trace.meta, s.trace.meta) else first.trace.trace
        checks = (("scenario", first.scenario.name, s.scenario.name), ("trace", trace, s.trace.trace),
                  ("token scale", first.trace.token_scale, s.trace.token_scale),
                  ("policies", list(first.policies), list(s.policies)))
        for what, a, b in checks:
            if a != b:
                raise InputError(f"{d}: not a repetition of {first_dir}: {what} {b!r} vs {a!r}")


def repetitions_markdown(runs: list[tuple[Path, RunSummary]]) -> str:
    """One table over repeated runs of one setup: per policy and metric the mean and its 95 %
    confidence interval (Student's t), with n; how many runs passed the fidelity verdict; the
    report's headline figures with intervals."""
    _same_setup(runs)
    first = runs[0][1]
    n = len(runs)
    header = ["policy", *(c[1] for c in REPEAT_COLUMNS), "fidelity passed"]
    traces = sorted({Path(s.trace.trace).name for _, s in runs})
    on = (f"{len(traces)} draws of one trace recipe (seeds {', '.join(str(s.trace.meta.get('seed')) for _, s in runs)})"
          if len(traces) > 1 else traces[0])
    lines = [f"# Repetitions: {first.scenario.name} on {on} (n = {n})", "",
             f"Runs: {', '.join(str(d) for d, _ in runs)}; dilations "
             f"{', '.join(f'{s.emulation.dilation:g}' for _, s in runs)}; times in {first.units}.",
             "Cells: mean ± half-width of the 95 % confidence interval (Student's t, n - 1 degrees of freedom).",
             "", *table_head(header)]
    for policy in first.policies:
        cells = [policy]
        for key, _, scale, fmt in REPEAT_COLUMNS:
            ci = mean_ci([getattr(s.policies[policy], key) for _, s in runs if getattr(s.policies[policy], key)
                          is not None])
            cells.append("-" if ci is None else ci.format(scale, fmt) + ("" if ci.n == n else f" (n={ci.n})"))
        cells.append(f"{sum(s.policies[policy].fidelity.passed for _, s in runs)}/{n}")
        lines.append(table_row(cells))
    rows = _paper_rows_over(runs)
    if rows:
        lines += ["", "The report's figures beside these runs':", "",
                  *markdown_table(["figure", "report", "these runs"], rows, "lrr")]
    return "\n".join(lines) + "\n"


def _paper_rows_over(runs: list[tuple[Path, RunSummary]]) -> list[tuple[str, str, str]]:
    def values(fn: Any) -> list[float]:
        out = []
        for _, s in runs:
            v = fn(s)
            if v is not None:
                out.append(v)
        return out

    def p50(name: str) -> Any:
        return lambda s: getattr(_first(s, name), "ttft_p50_s", None)

    def change(q: str, base: str) -> Any:
        def fn(s: RunSummary) -> float | None:
            new, old = _get(_first(s, "pdd"), q), _get(_first(s, base), q)
            return None if new is None or not old else 100 * (new - old) / old
        return fn

    def gap(s: RunSummary) -> float | None:
        a, b = p50("cross-dc")(s), p50("same-dc")(s)
        return None if a is None or b is None else a - b

    def q(name: str, key: str) -> Any:
        return lambda s: _get(_first(s, name), key)

    specs: list[tuple[str, str, Any, str, float, str]] = [
        ("same-dc TTFT P50", "4.2 s", p50("same-dc"), "{:.2f}", 1, " s"),
        ("cross-dc TTFT P50", "6.7 s", p50("cross-dc"), "{:.2f}", 1, " s"),
        ("cross-dc minus same-dc TTFT P50", "+2.5 s", gap, "{:+.2f}", 1, " s"),
        ("cross-dc TTFT P90", "18.3 s", q("cross-dc", "ttft_p90_s"), "{:.2f}", 1, " s"),
        ("cross-dc TTFT P99", "29.7 s", q("cross-dc", "ttft_p99_s"), "{:.2f}", 1, " s"),
        ("cross-dc WAN KV transfer P50", "(range 1-20 s)", q("cross-dc", "wan_transfer_p50_s"), "{:.2f}", 1, " s"),
    ]
    for pct in ("p50", "p90", "p99", "mean"):
        shown = pct.upper() if pct != "mean" else "mean"
        specs += [(f"PDD TTFT {shown} vs same-dc", "-51.5 % (percentile not stated)",
                   change(f"ttft_{pct}_s", "same-dc"), "{:+.1f}", 1, " %"),
                  (f"PDD TTFT {shown} vs cross-dc", "not stated", change(f"ttft_{pct}_s", "cross-dc"), "{:+.1f}", 1,
                   " %")]
    specs.append(("RLD share of output tokens (PDD)", "6.2 %", lambda s: _get(_first(s, "pdd"), "rld_share"),
                  "{:.1f}", 100, " %"))
    rows = []
    for label, said, fn, fmt, scale, unit in specs:
        ci = mean_ci(values(fn))
        if ci is not None:
            rows.append((label, said, f"{ci.format(scale, fmt)}{unit} (n={ci.n})"))
    lo, hi = values(q("cross-dc", "wan_transfer_min_s")), values(q("cross-dc", "wan_transfer_max_s"))
    if lo and hi:
        rows.insert(6, ("cross-dc WAN KV transfer time (min-max)", "1-20 s", f"{min(lo):.2f}-{max(hi):.2f} s "
                        f"(over {len(lo)} runs)"))
    return rows


def write_repetitions(run_dirs: list[Path], out: Path) -> Path:
    """``testbed report RUN_DIR RUN_DIR ... --out DIR``: the repetitions table of several runs."""
    runs = [(d, load_run(d)[0]) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "repetitions.md"
    write_atomic(path, repetitions_markdown(runs))
    return path
