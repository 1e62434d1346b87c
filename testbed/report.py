"""Results of a replay: saved (CSV, Parquet, JSON summary), plotted (PNG), printed side by side.

One folder per run (``runs/<timestamp>/`` unless ``--out``):
``requests.csv`` / ``requests.parquet`` (one row per request and policy), ``summary.json``
(trace, scenario, options, per-policy summary and worker statistics), ``latency.png``
(TTFT and TPOT distributions, TTFT over the run, TTFT percentiles per policy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from workers.contracts import WorkerStats  # noqa: E402

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


def comparison_table(summaries: dict[str, dict[str, Any]], columns: list[tuple[str, str, float, str]] | None = None
                     ) -> str:
    cols = columns or TABLE_COLUMNS
    header = ["policy"] + [c[1] for c in cols]
    rows = []
    for name, s in summaries.items():
        cells = [name]
        for key, _, scale, fmt in cols:
            v = s.get(key)
            cells.append("-" if v is None else fmt.format(v * scale))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    lines.append("-" * len(lines[0]))
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def save(out: Path, frames: dict[str, pd.DataFrame], summary: dict[str, Any],
         workers: dict[str, dict[str, WorkerStats]] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    df = pd.concat([f.assign(policy=name) for name, f in frames.items()], ignore_index=True)
    first = ["policy"] + [c for c in df.columns if c != "policy"]
    df = df[first]
    paths = [out / "requests.csv", out / "requests.parquet", out / "summary.json", out / "latency.png"]
    df.to_csv(paths[0], index=False)
    df.to_parquet(paths[1], index=False)
    paths[2].write_text(json.dumps(summary, indent=2, default=str))
    plot(df, paths[3])
    if workers and plot_hit_rates(workers, out / "hit_rates.png"):
        paths.append(out / "hit_rates.png")
    return paths


def plot_hit_rates(workers: dict[str, dict[str, WorkerStats]], path: Path, window_s: float = 5.0) -> bool:
    """Prefix-cache hit rate over time of every prefill and decode worker, per policy
    (hit tokens / looked-up tokens in each ``window_s`` window)."""
    policies = [p for p, ws in workers.items() if any(w.cache and w.cache.series for w in ws.values())]
    if not policies:
        return False
    fig, axes = plt.subplots(len(policies), 1, figsize=(10, 3 * len(policies)), squeeze=False)
    for ax, p in zip(axes[:, 0], policies, strict=True):
        t0 = min(w.cache.series[0][0] for w in workers[p].values() if w.cache and w.cache.series)
        for name, w in sorted(workers[p].items()):
            if w.cache is None or len(w.cache.series) < 2:
                continue
            a = np.asarray(w.cache.series, dtype=float)
            bins = np.floor((a[:, 0] - t0) / window_s)
            xs, ys = [], []
            prev_hit, prev_look = 0.0, 0.0
            for b in np.unique(bins):
                last = a[bins == b][-1]
                if last[2] > prev_look:
                    xs.append((b + 1) * window_s)
                    ys.append(100 * (last[1] - prev_hit) / (last[2] - prev_look))
                prev_hit, prev_look = last[1], last[2]
            ax.plot(xs, ys, marker=".", label=f"{name} (overall {100 * w.cache.hit_rate:.0f}%)")
        ax.set(title=f"{p}: prefix-cache hit rate per {window_s:g} s", xlabel="s into the run", ylabel="hit %",
               ylim=(0, 100))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _cdf(ax: Any, values: pd.Series, label: str) -> None:
    v = np.sort(values.dropna().to_numpy())
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot(df: pd.DataFrame, path: Path) -> None:
    ok = df[df.ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_ttft, ax_tpot, ax_time, ax_bar = axes.flat
    policies = list(dict.fromkeys(df.policy))
    for p in policies:
        d = ok[ok.policy == p]
        _cdf(ax_ttft, d.ttft_s, p)
        _cdf(ax_tpot, d.tpot_s * 1000, p)
        ax_time.scatter(d.sent_offset_s, d.ttft_s, s=6, label=p, alpha=0.6)
    ax_ttft.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT distribution")
    ax_tpot.set(xlabel="TPOT (ms)", ylabel="fraction of requests", title="TPOT distribution")
    ax_time.set(yscale="log", xlabel="sent at (s into the run)", ylabel="TTFT (s)", title="TTFT over the run")
    qs = [50, 90, 99]
    width = 0.8 / max(1, len(policies))
    for k, p in enumerate(policies):
        d = ok[ok.policy == p].ttft_s.dropna()
        vals = [float(np.percentile(d, q)) if len(d) else 0.0 for q in qs]
        ax_bar.bar(np.arange(len(qs)) + k * width, vals, width, label=p)
    ax_bar.set_xticks(np.arange(len(qs)) + width * (len(policies) - 1) / 2, [f"p{q}" for q in qs])
    ax_bar.set(ylabel="TTFT (s)", title="TTFT percentiles")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
