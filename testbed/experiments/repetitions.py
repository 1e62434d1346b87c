"""Repetitions over seeds: a generated trace drawn again from its own recipe.

A trace written by ``testbed trace gen`` carries its generator's parameters and seed in its
header line. ``--seeds N`` on ``sweep`` and ``calibrate`` replays N draws of that recipe:
seed ``s, s+1, ..., s+N-1`` (``s`` the file's own seed, so the first draw is the file as
shipped). Draws differ in the workload sample (session starts, lengths, shared prompts,
think times, which turns hit) besides the host's noise and the line's random jitter and loss,
so an interval over them says how much a figure depends on the sample. Each draw is written
beside the results (``traces/seed-<s>.jsonl``), so every saved run names a trace that
exists and ``testbed report`` can rebuild it.

Tables over the draws give the mean and the half-width of the 95 % confidence interval
(``testbed.analysis.confidence``) and say n. A trace without a recipe (Mooncake, Azure, a request
list) is refused for N > 1: it is one sample, and repeating it measures only noise (repeat
``testbed run`` and tabulate with ``testbed report RUN... --out`` for that).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.analysis.confidence import mean_ci
from testbed.analysis.results import write_csv
from testbed.analysis.tables import table_head
from testbed.errors import InputError
from testbed.experiments.load_sweep import Draw, SweepResult
from testbed.outputs import write_atomic
from testbed.traces import load_trace
from testbed.traces.generate import RECIPE_GENERATOR, GenConfig, generate, write_jsonl
from testbed.traces.workload import Workload

if TYPE_CHECKING:
    import pandas as pd


def recipe_of(wl: Workload) -> dict[str, object]:
    """The generator parameters in ``wl``'s header, or an error saying why there are none."""
    if wl.meta.get("generator") != RECIPE_GENERATOR or "seed" not in wl.meta:
        raise InputError(f"{wl.source}: --seeds above 1 needs a trace written by `{RECIPE_GENERATOR}` (its "
                         "header holds the recipe to draw again); this one has none. Repeat `testbed run` and "
                         "tabulate the runs with `testbed report RUN... --out DIR` instead.")
    return dict(wl.meta)


def draw(wl: Workload, seed: int, out: Path) -> Path:
    """Write the draw of ``wl``'s recipe with ``seed`` to ``out/traces/seed-<seed>.jsonl``."""

    recipe = recipe_of(wl)
    names = {f.name for f in dataclasses.fields(GenConfig)}
    cfg = GenConfig(**{k: v for k, v in recipe.items() if k in names})  # type: ignore[arg-type]
    cfg.seed = seed
    sessions, header = generate(cfg)
    path = out / "traces" / f"seed-{seed}.jsonl"
    write_jsonl(path, sessions, header)
    return path


def draws(wl: Workload, n: int, out: Path, limit: int | None,
          window: tuple[float, float] | None) -> list[Draw]:
    """``n`` draws: ``wl`` itself, then its recipe with the next ``n - 1`` seeds, each loaded
    at ``wl``'s token scale and cut by the same ``limit`` / ``window``."""

    if n < 1:
        raise InputError(f"--seeds: at least 1, got {n}")
    if n == 1:
        return [Draw(int(str(wl.meta.get("seed", 0))), wl)]
    first = int(str(recipe_of(wl)["seed"]))
    out_draws = [Draw(first, wl)]
    for seed in range(first + 1, first + n):
        path = draw(wl, seed, out)
        cap = wl.meta.get("max_context")  # the first draw's context cap, on every draw
        w = load_trace(path, "sessions", wl.token_scale, cap["tokens"] if isinstance(cap, dict) else None)
        w = w.select(limit, window)
        if not w.requests:
            raise InputError(f"{path}: --window/--limit leave no request")
        out_draws.append(Draw(seed, w))
    return out_draws


# ------------------------------------------------------------------ tables over the draws
def _ci(values: list[float | None], scale: float = 1.0, fmt: str = "{:.2f}", unit: str = "") -> str:
    ci = mean_ci([v for v in values if v is not None])
    if ci is None:
        return "-"
    return f"{ci.format(scale, fmt)}{unit}" + (f" (n={ci.n})" if ci.n != len(values) else "")


def _gain(new: float | None, base: float | None) -> float | None:
    return None if new is None or not base else new / base - 1


def seeded_sweep_markdown(results: list[tuple[int, SweepResult]]) -> str:
    """The load sweep over draws: per load and policy SLO attainment and TTFT P50; per
    policy SLA throughput and BCR; PDD's gain over same-dc per draw, then its mean."""
    from testbed.experiments.load_sweep import REPORT_SLA_GAIN, unbounded

    first = results[0][1]
    n = len(results)
    seeds = ", ".join(str(s) for s, _ in results)
    lines = [f"# Load sweep over {n} draws of the trace (seeds {seeds}; D = {first.dilation:g}; SLO: TTFT <= "
             f"{first.slo_ttft_s:g} s and TPOT <= {first.slo_tpot_s:g} s for {100 * first.share:.0f} % of requests)",
             "", "Cells: mean ± half-width of the 95 % confidence interval over the draws (Student's t); n = "
             f"{n} unless said. Each draw's own table: `seed-<s>/sweep.md`.", "",
             *table_head(["load", "policy", "SLO met %", "TTFT P50 s", "TTFT P99 s", "fidelity passed"], "rlrrrr")]
    keys = sorted({(p.load, p.policy) for _, r in results for p in r.points})
    for load, policy in keys:
        pts = [p for _, r in results for p in r.points if p.load == load and p.policy == policy]
        lines.append(f"| {load:g} | {policy} | {_ci([p.slo_attainment for p in pts], 100, '{:.0f}')} | "
                     f"{_ci([p.ttft_p50_s for p in pts])} | {_ci([p.ttft_p99_s for p in pts])} | "
                     f"{sum(p.fidelity_passed for p in pts)}/{len(pts)} |")
    lines += ["", "## SLA throughput", "",
              *table_head(["policy", "highest load meeting the SLO", "rps", "BCR (rps per price)", "BCR with egress"],
                          "lrrrr")]
    for policy in [t.policy for t in first.sla]:
        ts = [next(t for t in r.sla if t.policy == policy) for _, r in results]
        bcr, with_egress = _ci([t.bcr for t in ts], 1, "{:.5f}"), _ci([t.bcr_with_egress for t in ts], 1, "{:.5f}")
        lines.append(f"| {policy} | {_ci([t.load for t in ts], 1, '{:.2f}')} | {_ci([t.rps for t in ts], 1, '{:.3f}')}"
                     f" | {bcr} | {with_egress} |")
    gains, bcr_gains, egress_gains = [], [], []
    for _, r in results:
        base = next((t for t in r.sla if t.policy.startswith("same-dc")), None)
        pdd = next((t for t in r.sla if t.policy.startswith("pdd")), None)
        if base and pdd:
            gains.append(_gain(pdd.rps, base.rps))
            bcr_gains.append(_gain(pdd.bcr, base.bcr))
            egress_gains.append(_gain(pdd.bcr_with_egress, base.bcr_with_egress))
    if gains:
        lines += ["", f"PDD's SLA throughput over same-dc: {_ci(gains, 100, '{:+.1f}', ' %')} (per draw: "
                      f"{', '.join('-' if g is None else f'{100 * g:+.1f} %' for g in gains)}; the report: "
                      f"+{100 * REPORT_SLA_GAIN:.1f} %); the step of the sweep bounds each draw's precision."]
        if any(g is not None for g in bcr_gains):
            lines.append(f"BCR over same-dc: {_ci(bcr_gains, 100, '{:+.1f}', ' %')} (the report: up to +37.5 %); "
                         f"with egress: {_ci(egress_gains, 100, '{:+.1f}', ' %')}.")
    caveats = {c for _, r in results if (c := unbounded(r))}
    lines += ["", *sorted(caveats)] if caveats else []
    return "\n".join(lines) + "\n"


def write_seeded_sweep(results: list[tuple[int, SweepResult]], out: Path) -> list[Path]:
    """``sweep.md`` (means and intervals), ``sweep_seeds.csv`` (every draw's points, with its
    seed) and ``sweep.png`` (the means) in ``out``."""
    import pandas as pd

    from testbed.analysis import plots

    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame([{"seed": s, **p.model_dump()} for s, r in results for p in r.points])
    write_csv(df, out / "sweep_seeds.csv")
    means = df.groupby(["load", "policy"], sort=False, as_index=False)[
        ["slo_attainment", "ttft_p50_s", "ttft_p99_s"]].mean()
    plots.plot_sweep(means, out / "sweep.png", results[0][1].share)
    write_atomic(out / "sweep.md", seeded_sweep_markdown(results))
    return [out / "sweep.md", out / "sweep_seeds.csv", out / "sweep.png"]


BATHTUB_COLUMNS = ("ttft_mean_change", "ttft_p50_change", "slo_points")


def seeded_bathtub(curves: list[tuple[int, pd.DataFrame]]) -> pd.DataFrame:
    """Per hit rate, each benefit's mean over the draws, its 95 % half-width and n."""
    import pandas as pd


    pooled = pd.concat([c.assign(seed=s) for s, c in curves], ignore_index=True)
    rows = []
    for h, g in pooled.groupby("hit_target", sort=True):
        row: dict[str, float | int | None] = {"hit_target": float(h), "hit_measured": g.hit_measured.mean(),
                                              "n": len(g)}
        for col in ("pass_fill", "base_pass_fill"):  # how full packed prefill passes ran (mean; None: unpacked)
            row[col] = g[col].mean() if col in g and g[col].notna().any() else None
        for col in BATHTUB_COLUMNS:
            ci = mean_ci([float(v) for v in g[col] if v is not None and not pd.isna(v)])
            row[col] = None if ci is None else ci.mean
            row[f"{col}_half"] = None if ci is None else ci.half
        rows.append(row)
    return pd.DataFrame(rows)


def write_seeded_bathtub(curves: list[tuple[int, pd.DataFrame]], out: Path, base: str, pdd: str) -> list[Path]:
    """``bathtub.csv`` (means, half-widths, n), ``bathtub.md`` and ``bathtub.png`` in ``out``."""
    import pandas as pd

    from testbed.analysis import plots

    agg = seeded_bathtub(curves)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(agg, out / "bathtub.csv")
    plots.plot_bathtub(agg, out / "bathtub.png", base, pdd)

    def cell(r: pd.Series, col: str, scale: float, fmt: str) -> str:
        m, h = r[col], r[f"{col}_half"]
        if m is None or pd.isna(m):
            return "-"
        return fmt.format(m * scale) + ("" if h is None or pd.isna(h) else " ± " + fmt.format(h * scale).lstrip("+"))

    seeds = ", ".join(str(s) for s, _ in curves)
    lines = [f"# {pdd} against {base} across prefix-hit rates, over {len(curves)} draws (seeds {seeds})", "",
             "Cells: mean ± half-width of the 95 % confidence interval over the draws; TTFT changes in % "
             "(negative: PDD faster), SLO attainment in points. Each draw's own table: `seed-<s>/bathtub.md`.", "",
             *table_head(["hit rate", "measured hit", "mean TTFT", "P50 TTFT", "SLO met (points)",
                          f"prefill passes full ({pdd} / {base})", "n"], "rrrrrrr")]

    def full(v: object) -> str:
        return "-" if v is None or pd.isna(v) else f"{100 * float(v):.0f} %"  # type: ignore[arg-type]

    for _, r in agg.iterrows():
        hit = "-" if pd.isna(r.hit_measured) else f"{100 * r.hit_measured:.1f} %"
        lines.append(f"| {r.hit_target:g} | {hit} | {cell(r, 'ttft_mean_change', 100, '{:+.1f}')} | "
                     f"{cell(r, 'ttft_p50_change', 100, '{:+.1f}')} | {cell(r, 'slo_points', 1, '{:+.1f}')} | "
                     f"{full(r.get('pass_fill'))} / {full(r.get('base_pass_fill'))} | {int(r.n)} |")
    write_atomic(out / "bathtub.md", "\n".join(lines) + "\n")
    return [out / "bathtub.csv", out / "bathtub.md", out / "bathtub.png"]
