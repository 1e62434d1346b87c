"""Plots of a run, drawn from its request rows (and worker statistics) alone.

* ``plot`` -> ``latency.png``: TTFT (log axis) and TPOT distributions, TTFT over the run,
  TTFT percentiles per policy;
* ``plot_ttft_by_hit`` -> ``ttft_by_hit.png``: TTFT P50/P99 per prefix-hit bucket;
* ``plot_timeline`` -> ``timeline.png``: KV on the WAN over time, per-worker decode load;
* ``plot_hit_rates`` -> ``hit_rates.png``: every worker's prefix-cache hit rate over time.
* ``plot_sweep`` -> ``sweep.png``: SLO attainment and TTFT against offered load (a sweep).
* ``plot_bathtub`` -> ``bathtub.png``: PDD's benefit against the baseline per prefix-hit rate.
* ``plot_tornado`` -> ``tornado.png``: how far each unknown moves each headline figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from protocol.worker_config import WorkerStats  # noqa: E402
from testbed.analysis.results import WanLine  # noqa: E402
from testbed.outputs import atomic_path  # noqa: E402

HIT_EDGES = [0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0001]


def plot_ttft_by_hit(df: pd.DataFrame, path: Path) -> None:
    """TTFT P50 and P99 per prefix-hit bucket (hit tokens at the prefill / prompt tokens)."""
    ok = df[df.ok & df.prefill_hit_tokens.notna()].copy()
    ok["hit"] = ok.prefill_hit_tokens.astype(float) / ok.prompt_tokens.clip(lower=1)
    labels = [f"{100 * lo:.0f}-{min(100.0, 100 * hi):.0f}%" for lo, hi in zip(HIT_EDGES, HIT_EDGES[1:], strict=False)]
    ok["bucket"] = pd.cut(ok.hit, HIT_EDGES, right=False, labels=labels)
    policies = list(dict.fromkeys(df.policy))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(policies))
    x = np.arange(len(labels))
    for ax, q in zip(axes, (50, 99), strict=True):
        for k, p in enumerate(policies):
            mine = ok[ok.policy == p]
            vals = [float(np.percentile(v, q)) if len(v) else np.nan
                    for v in (mine[mine.bucket == b].ttft_s.to_numpy() for b in labels)]
            ax.bar(x + k * width, vals, width, label=p)
        counts = [int((ok[ok.policy == policies[0]].bucket == b).sum()) for b in labels] if policies else []
        ticks = [f"{b}\nn={n}" for b, n in zip(labels, counts, strict=False)]
        ax.set_xticks(x + width * (len(policies) - 1) / 2, ticks)
        ax.set(yscale="log", xlabel="prefix hit at the prefill", ylabel="TTFT (s)", title=f"TTFT P{q} by prefix hit")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def _covering(starts: np.ndarray, ends: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """How many [start, end) intervals cover each grid point."""
    return (starts[None, :] <= grid[:, None]).sum(axis=1) - (ends[None, :] <= grid[:, None]).sum(axis=1)


def plot_timeline(df: pd.DataFrame, path: Path, byte_factor: float = 1.0, points: int = 400,
                  rates: dict[str, dict[str, list[tuple[float, float]]]] | None = None,
                  lines: dict[str, dict[str, WanLine]] | None = None) -> None:
    """Per policy: KV on the WAN over time, times ``byte_factor``, per direction as it crossed
    the line (``lines``: policy -> direction -> the line's counters), or where nothing counted
    it (netem) each transfer's bytes spread evenly over its duration, labelled so; with the
    line's rate per direction (``rates``: policy -> direction -> (s, Mbit/s) at each change,
    as a link trace or a fault set it); and the requests each relay and decoder was decoding
    (first token, or the main decoder's takeover, to the last token)."""
    policies = list(dict.fromkeys(df.policy))
    fig, axes = plt.subplots(len(policies), 2, figsize=(12, 3 * max(1, len(policies))), squeeze=False)
    for (ax_wan, ax_load), p in zip(axes, policies, strict=True):
        d = df[df.policy == p]
        ok = d[d.ok & d.ttft_s.notna()]
        end = float(np.nanmax([(ok.sent_offset_s + ok.e2e_s).max(), d.wan_end_s.max(), 1.0]))
        grid = np.linspace(0.0, end, points)
        step = grid[1] - grid[0]
        counted = (lines or {}).get(p, {})
        for direction, line in counted.items():
            if not any(line.wire_bytes):
                continue
            xs = line.start_s + line.bin_s * np.arange(len(line.wire_bytes) + 1)
            gbit = np.asarray(line.wire_bytes, dtype=float) * 8 * byte_factor / line.bin_s / 1e9
            ax_wan.stairs(gbit, xs, label=f"KV {direction}, as it crossed")
        if not counted:
            rate = np.zeros_like(grid)
            for r in d[d.wan_start_s.notna() & (d.wan_kv_bytes > 0)].itertuples():
                span = max(r.wan_end_s - r.wan_start_s, step)
                bits = 8 * r.wan_kv_bytes * byte_factor
                rate += ((grid >= r.wan_start_s) & (grid < r.wan_start_s + span)) * (bits / span / 1e9)
            ax_wan.plot(grid, rate, label="KV, spread over each transfer")
        for direction, steps in (rates or {}).get(p, {}).items():
            xs = [t for t, _ in steps] + [end]
            ax_wan.step(xs, [m / 1e3 for _, m in steps] + [steps[-1][1] / 1e3], where="post", linestyle="--",
                        label=f"line {direction}")
        if ax_wan.lines or ax_wan.patches:
            ax_wan.legend(fontsize=8)
        ax_wan.set(title=f"{p}: KV on the WAN", xlabel="s into the run", ylabel="Gbit/s")
        first = (ok.sent_offset_s + ok.ttft_s).to_numpy()
        last = (ok.sent_offset_s + ok.e2e_s).to_numpy()
        takeover = np.where(ok.handoff_at_s.notna(), ok.handoff_at_s, first)
        relayed = (ok.relay.notna() & (ok.relay != ok.decode_worker)).to_numpy()
        for w in sorted(set(ok.decode_worker.dropna()) | set(ok.relay.dropna())):
            as_decoder = (ok.decode_worker == w).to_numpy()
            as_relay = (ok.relay == w).to_numpy() & relayed
            starts = np.concatenate([np.where(relayed, takeover, first)[as_decoder], first[as_relay]])
            ends = np.concatenate([last[as_decoder], np.minimum(takeover, last)[as_relay]])
            ax_load.plot(grid, _covering(starts, ends, grid), label=w)
        ax_load.set(title=f"{p}: requests decoding per worker", xlabel="s into the run", ylabel="requests")
        for ax in (ax_wan, ax_load):
            ax.grid(alpha=0.3)
        if ax_load.lines:
            ax_load.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


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
        if ax.get_legend_handles_labels()[0]:  # a run too short for a series has no line to name
            ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 100)
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
    _save(fig, path, 100)
    plt.close(fig)


def plot_rss(rss: pd.DataFrame, path: Path) -> None:
    """Resident memory of every process over a soak (one line per process incarnation)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (name, pid), g in rss.groupby(["process", "pid"]):
        ax.plot(g.t_s / 60, g.rss_mb, lw=1, label=f"{name} ({pid})")
    ax.set_xlabel("minutes into the soak")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("memory of every process")
    if len(rss):
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path, 120)
    plt.close(fig)


def plot_sweep(points: pd.DataFrame, path: Path, share: float) -> None:
    """A load sweep: SLO attainment and TTFT P50/P99 against offered load, per policy."""
    fig, (ax_slo, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy, g in points.groupby("policy", sort=False):
        g = g.sort_values("load")
        ax_slo.plot(g.load, 100 * g.slo_attainment.astype(float), marker="o", label=policy)
        line = ax_ttft.plot(g.load, g.ttft_p50_s.astype(float), marker="o", label=f"{policy} P50")[0]
        ax_ttft.plot(g.load, g.ttft_p99_s.astype(float), marker="x", ls="--", color=line.get_color(),
                     label=f"{policy} P99")
    ax_slo.axhline(100 * share, color="grey", ls=":", label=f"{100 * share:.0f} % target")
    ax_slo.set(xlabel="load (x the trace's rate)", ylabel="requests meeting the SLO (%)", title="SLO attainment")
    ax_ttft.set(xlabel="load (x the trace's rate)", ylabel="TTFT (s)", yscale="log", title="TTFT")
    for ax in (ax_slo, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path, 110)
    plt.close(fig)


def plot_bathtub(curve: pd.DataFrame, path: Path, base: str, policy: str) -> None:
    """``policy``'s TTFT change and SLO attainment difference against ``base`` per prefix-hit rate."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if len(curve):
        x = 100 * curve.hit_target
        # Over several draws the curve holds means and the half-widths of their 95 % intervals.
        for col, scale, style, label in (("ttft_mean_change", -100, {"marker": "o"}, "mean TTFT reduction (%)"),
                                         ("ttft_p50_change", -100, {"marker": "x"}, "P50 TTFT reduction (%)"),
                                         ("slo_points", 1, {"marker": "s", "ls": "--"},
                                          "SLO attainment gain (points)")):
            half = curve.get(f"{col}_half")
            err = None if half is None else abs(scale) * half.astype(float)
            ax.errorbar(x, scale * curve[col].astype(float), yerr=err, capsize=3, label=label, **style)
        fills = [(c, lab) for c, lab in (("pass_fill", policy), ("base_pass_fill", base))
                 if c in curve and curve[c].notna().any()]
        if fills:  # packed prefill passes: how full they ran beside the curve
            ax2 = ax.twinx()
            for c, lab in fills:
                ax2.plot(x, 100 * curve[c].astype(float), ls=":", marker=".", label=f"{lab}: prefill passes full (%)")
            ax2.set(ylabel="prefill passes full (%)", ylim=(0, 105))
            ax2.legend(fontsize=8, loc="lower right")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="prefix-hit rate (%)", ylabel="benefit", title=f"{policy} against {base} by hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 110)
    plt.close(fig)


def plot_tornado(rows: list[tuple[str, str, float | None, float | None]], figures: list[tuple[str, str, str]],
                 path: Path) -> None:
    """One panel per figure (``figures``: field, label, "s" or "pp"); per unknown a bar from 0
    to its change at the low end and one to the high end (``rows``: field, unknown, low, high),
    the unknown that moves the figure most on top."""
    fig, axes = plt.subplots(2, (len(figures) + 1) // 2, figsize=(14, 6), squeeze=False)
    for ax, (field, label, unit) in zip(axes.flat, figures, strict=False):
        scale = 1.0 if unit == "s" else 100.0
        mine = [(u, scale * (lo or 0.0), scale * (hi or 0.0)) for f, u, lo, hi in rows if f == field]
        mine.sort(key=lambda x: max(abs(x[1]), abs(x[2])))
        y = np.arange(len(mine))
        ax.barh(y, [lo for _, lo, _ in mine], color="tab:blue", label="low end")
        ax.barh(y, [hi for _, _, hi in mine], color="tab:orange", alpha=0.7, label="high end")
        ax.set_yticks(y, [u for u, _, _ in mine])
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("change from the baseline (" + ("s" if unit == "s" else "percentage points") + ")")
    for ax in list(axes.flat)[len(figures):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 110)


def plot_tune(trials: list[tuple[float | None, float | None, int]], front: list[tuple[float | None, float | None]],
              marks: dict[int, str], title: str, path: Path) -> None:
    """A knob search: goodput per price against P99 TTFT per trial, the Pareto front joined."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [(x, y, n) for x, y, n in trials if x is not None and y is not None]
    ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], c="grey", s=18, label="trial")
    line = sorted((x, y) for x, y in front if x is not None and y is not None)
    ax.plot([x for x, _ in line], [y for _, y in line], "o-", color="C0", label="Pareto front")
    for x, y, n in pts:
        if n in marks:
            ax.annotate(marks[n], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("P99 TTFT (emulated s)")
    ax.set_ylabel("goodput per price")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 110)
    plt.close(fig)


def _save(fig: Any, path: Path, dpi: int) -> None:
    """The figure whole or not at all (a reader never sees half a PNG)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi)


def plot_gap_vs_kv(rows: list[tuple[str, float, float | None, float | None]], path: Path) -> None:
    """Cross-dc minus same-dc TTFT P50 against the MB a request puts on the line (its KV
    and its state), one line per line rate (``rows``: card, rate Gbit/s, MB, gap), each
    point named by its card."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for rate in sorted({r for _, r, _, _ in rows}):
        pts = sorted((mb, gap, card) for card, r, mb, gap in rows if r == rate and gap is not None and mb)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{rate:g} Gbit/s")
        for mb, gap, card in pts:
            ax.annotate(card, (mb, gap), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(2.5, color="grey", linestyle=":", label="the report's +2.5 s")
    ax.set_xscale("log")
    ax.set_xlabel("KV and state a request puts on the line (MB, emulated, mean)")
    ax.set_ylabel("cross-dc minus same-dc TTFT P50 (s)")
    ax.set_title("What decode across the line adds, per model and line")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    _save(fig, path, 110)
    plt.close(fig)
