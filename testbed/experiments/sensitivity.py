"""``testbed sensitivity``: the headline figures across the range of what the report leaves
unknown, one unknown at a time, and a tornado plot of which moves which figure.

The report names ranges, not values, for four things this testbed has to choose: the line
(10-100 Gbit/s), the round trip between the datacenters (10-40 ms here), the traffic's mean
prefix hit (80-95 %) and the load (here +-25 % of the calibrated point). The baseline is the
scenario and trace as given at ``--load``; each variant changes one unknown to one end of its
range and replays every policy (same-dc, cross-dc, pdd) on a fresh network, at one dilation
for all. The mean hit moves through the trace's recipe: its share of cold requests (long
input, low hit, short output: the generator's ``anomalous_share``) is bisected until the
recipe's mean hit (with cached answers, as the trace was made) is the target, so sessions,
arrivals and lengths keep their shape.

Saved: ``sensitivity.json`` (``SensitivityResult``), ``sensitivity.md``, ``tornado.png``;
each variant's run folder under ``<out>/<variant>/`` (``testbed report`` rebuilds it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from testbed.analysis.results import RunSummary, load_run
from testbed.analysis.tables import table_head
from testbed.errors import InputError
from testbed.experiments.load_sweep import fixed_dilation
from testbed.experiments.parallel import Replay, run_all
from testbed.experiments.repetitions import recipe_of
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.outputs import write_atomic
from testbed.policies import PolicySpec, parse_policy_list
from testbed.scenario import Scenario
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate, write_jsonl
from testbed.traces.stats import trace_stats
from testbed.traces.workload import Workload

POLICIES = "same-dc,cross-dc,pdd"
HIT_TOLERANCE = 0.01  # the recipe's mean hit within a point of the target


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # folder name
    unknown: str  # what it moves
    level: str  # to what, in words
    rate_mbit: float | None = None
    one_way_ms: float | None = None
    mean_hit: float | None = None
    load_factor: float = 1.0


# The report's ranges (docs/results.md, "Sensitivity").
VARIANTS = (
    Variant("line-10g", "line", "10 Gbit/s", rate_mbit=10_000),
    Variant("line-100g", "line", "100 Gbit/s", rate_mbit=100_000),
    Variant("rtt-10ms", "RTT", "10 ms", one_way_ms=5.0),
    Variant("rtt-40ms", "RTT", "40 ms", one_way_ms=20.0),
    Variant("hit-80", "mean hit", "80 %", mean_hit=0.80),
    Variant("hit-95", "mean hit", "95 %", mean_hit=0.95),
    Variant("load-minus-25", "load", "-25 %", load_factor=0.75),
    Variant("load-plus-25", "load", "+25 %", load_factor=1.25),
)


class Figures(BaseModel):
    """The headline figures of one run (emulated seconds; changes as fractions)."""

    model_config = ConfigDict(extra="forbid")

    gap_p50_s: float | None  # cross-dc minus same-dc TTFT P50
    cross_p90_s: float | None
    cross_p99_s: float | None
    pdd_vs_same_mean: float | None  # PDD's mean TTFT against same-dc's
    pdd_vs_cross_p99: float | None  # PDD's P99 TTFT against cross-dc's
    rld_share: float | None

    @classmethod
    def of(cls, s: RunSummary) -> Figures:
        def get(policy: str, key: str) -> float | None:
            p = next((v for k, v in s.policies.items() if k.split(":")[0] == policy), None)
            return None if p is None else getattr(p, key)

        def change(a: float | None, b: float | None) -> float | None:
            return None if a is None or not b else a / b - 1

        same, cross = get("same-dc", "ttft_p50_s"), get("cross-dc", "ttft_p50_s")
        return cls(gap_p50_s=None if same is None or cross is None else cross - same,
                   cross_p90_s=get("cross-dc", "ttft_p90_s"), cross_p99_s=get("cross-dc", "ttft_p99_s"),
                   pdd_vs_same_mean=change(get("pdd", "ttft_mean_s"), get("same-dc", "ttft_mean_s")),
                   pdd_vs_cross_p99=change(get("pdd", "ttft_p99_s"), get("cross-dc", "ttft_p99_s")),
                   rld_share=get("pdd", "rld_share"))


# (field, label, unit of a change: "s" or "pp") in the table's and the plot's order
FIGURES = (("gap_p50_s", "cross-dc - same-dc TTFT P50", "s"), ("cross_p90_s", "cross-dc TTFT P90", "s"),
           ("cross_p99_s", "cross-dc TTFT P99", "s"), ("pdd_vs_same_mean", "PDD mean TTFT vs same-dc", "pp"),
           ("pdd_vs_cross_p99", "PDD P99 TTFT vs cross-dc", "pp"), ("rld_share", "RLD share", "pp"))


class VariantResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    unknown: str
    level: str
    run_dir: str
    mean_hit: float | None = None  # the variant trace's recipe mean hit (hit variants)
    figures: Figures
    fidelity_passed: bool


class SensitivityResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: str
    trace: str
    load: float
    requests: int
    dilation: float
    baseline: VariantResult
    variants: list[VariantResult]


def with_wan(sc: Scenario, rate_mbit: float | None, one_way_ms: float | None) -> Scenario:
    """``sc`` with both directions of its line at that rate and one-way delay."""
    raw = sc.model_dump(mode="json")
    for direction in ("forward", "reverse"):
        if rate_mbit is not None:
            raw["wan"][direction]["rate_mbit"] = rate_mbit
        if one_way_ms is not None:
            raw["wan"][direction]["delay_ms"] = one_way_ms
            raw["wan"][direction]["jitter_ms"] = min(raw["wan"][direction].get("jitter_ms") or 0.0, one_way_ms)
    return Scenario.model_validate(raw).model_copy(update={"source": sc.source})


def with_mean_hit(wl: Workload, target: float, out: Path, limit: int | None) -> tuple[Workload, float]:
    """``wl``'s recipe with its share of cold requests bisected until its mean hit is
    ``target`` (written under ``out/traces/``): the workload and the mean it reached."""
    recipe = recipe_of(wl)
    names = {f.name for f in dataclasses.fields(GenConfig)}
    cfg = GenConfig(**{k: v for k, v in recipe.items() if k in names})  # type: ignore[arg-type]
    path = out / "traces" / f"hit-{round(100 * target)}.jsonl"

    def mean_hit(share: float) -> float:
        sessions, header = generate(dataclasses.replace(cfg, anomalous_share=share))
        write_jsonl(path, sessions, header)
        return trace_stats(load_trace(path, "sessions", wl.token_scale)).mean_hit_rate

    lo, hi = 0.0, 0.45  # the mean hit falls as the cold share grows (the generator takes < 0.5)
    reached = mean_hit(lo)
    if reached < target - HIT_TOLERANCE:  # even without cold requests: every other one hot
        cfg = dataclasses.replace(cfg, above_95=1.0)
        reached = mean_hit(lo)
    # Each share is a draw of its own (which requests are cold moves the rest), so the mean is
    # not exactly monotone in it: bisect, and keep the closest draw seen.
    best, written = (abs(reached - target), lo, reached), lo
    for _ in range(14):
        if best[0] <= HIT_TOLERANCE / 2:
            break
        written = (lo + hi) / 2
        reached = mean_hit(written)
        best = min(best, (abs(reached - target), written, reached))
        lo, hi = (written, hi) if reached > target else (lo, written)
    reached = best[2]
    if best[1] != written:  # the file holds the last draw: write the closest again
        mean_hit(best[1])
    if abs(reached - target) > HIT_TOLERANCE:
        raise InputError(f"{wl.source}: its recipe reaches no mean hit within {100 * HIT_TOLERANCE:g} points of "
                         f"{100 * target:g} % (closest {100 * reached:.1f} %)")
    return load_trace(path, "sessions", wl.token_scale).select(limit), reached


def sensitivity(sc: Scenario, wl: Workload, load: float, opts: RunOptions, out: Path,
                variants: tuple[Variant, ...] = VARIANTS,
                policies: list[PolicySpec] | None = None,
                run: Callable[..., int] = run_trace) -> SensitivityResult:
    """The baseline and every variant (see the module docstring): each row's run folder saved as
    it ends (simulations side by side), the table once all have."""
    if load <= 0:
        raise InputError(f"--load: must be positive, got {load}")
    policies = policies or parse_policy_list(POLICIES)
    opts = fixed_dilation(sc, wl, opts)
    assert isinstance(opts.dilation, float)
    out.mkdir(parents=True, exist_ok=True)

    def replay(name: str, unknown: str, level: str, sc_v: Scenario, wl_v: Workload, load_v: float) -> Replay:
        print(f"\n== sensitivity {name}: {unknown} {level} -> {out / name}", flush=True)
        return Replay(sc_v, wl_v, policies, dataclasses.replace(opts, speed=load_v, out=out / name,
                                                                allow_infidelity=True))

    def measured(name: str, unknown: str, level: str, hit: float | None = None) -> VariantResult:
        summary, _ = load_run(out / name)
        return VariantResult(name=name, unknown=unknown, level=level, run_dir=str(out / name), mean_hit=hit,
                             figures=Figures.of(summary),
                             fidelity_passed=all(p.fidelity.passed for p in summary.policies.values()))

    # Every row's replay first (simulations side by side: ``parallel.run_all``), then the table.
    replays = [replay("baseline", "none", "as given", sc, wl, load)]
    hits: dict[str, float | None] = {}
    for v in variants:
        if _is_baseline(sc, v):  # the scenario is already at this end: the baseline is this row
            continue
        sc_v = with_wan(sc, v.rate_mbit, v.one_way_ms) if v.rate_mbit or v.one_way_ms else sc
        wl_v, hits[v.name] = (with_mean_hit(wl, v.mean_hit, out, opts.limit) if v.mean_hit is not None
                              else (wl, None))
        replays.append(replay(v.name, v.unknown, v.level, sc_v, wl_v, load * v.load_factor))
    if run is run_trace:
        run_all(replays)
    else:  # a test's stand-in for ``testbed run``
        for r in replays:
            run(r.sc, r.wl, r.policies, r.opts)
    baseline = measured("baseline", "none", "as given")
    result = SensitivityResult(scenario=str(sc.source), trace=str(wl.source), load=load, requests=len(wl.requests),
                               dilation=opts.dilation, baseline=baseline, variants=[])
    for v in variants:
        if v.name not in hits:
            result.variants.append(baseline.model_copy(update={"name": v.name, "unknown": v.unknown,
                                                               "level": f"{v.level} (the baseline)"}))
        else:
            result.variants.append(measured(v.name, v.unknown, v.level, hits[v.name]))
    save(result, out)
    return result


def _is_baseline(sc: Scenario, v: Variant) -> bool:
    lines = (sc.wan.forward, sc.wan.reverse)
    return (v.mean_hit is None and v.load_factor == 1.0
            and (v.rate_mbit is None or all(w.rate_mbit == v.rate_mbit for w in lines))
            and (v.one_way_ms is None or all(w.delay_ms == v.one_way_ms for w in lines)))


def save(r: SensitivityResult, out: Path) -> list[Path]:
    from testbed.analysis.plots import plot_tornado  # matplotlib

    write_atomic(out / "sensitivity.json", r.model_dump_json(indent=2))
    write_atomic(out / "sensitivity.md", markdown(r))
    plot_tornado(tornado_rows(r), list(FIGURES), out / "tornado.png")
    return [out / "sensitivity.json", out / "sensitivity.md", out / "tornado.png"]


def _value(field: str, v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    if field.endswith("_s"):
        return f"{v:.2f} s"
    return f"{100 * v:.1f} %" if field == "rld_share" else f"{100 * v:+.1f} %"


def _delta(v: float | None, unit: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:+.2f} s" if unit == "s" else f"{100 * v:+.1f} pp"


def markdown(r: SensitivityResult) -> str:
    lines = [f"# Sensitivity ({r.requests} requests per policy, load {r.load:g}x, D = {r.dilation:g})", "",
             f"Scenario `{r.scenario}`, trace `{r.trace}`. One unknown at a time; every other as the baseline. "
             "One draw per row: a row that repeats the baseline shows the run-to-run noise.", "",
             *table_head(["unknown", "level", *[label for _, label, _ in FIGURES], "fidelity"],
                         "ll" + "r" * len(FIGURES) + "l")]
    for v in [r.baseline, *r.variants]:
        level = v.level + (f" (recipe {100 * v.mean_hit:.1f} %)" if v.mean_hit is not None else "")
        cells = [_value(f, getattr(v.figures, f)) for f, _, _ in FIGURES]
        lines.append(f"| {v.unknown} | {level} | {' | '.join(cells)} | {'ok' if v.fidelity_passed else 'FAILED'} |")
    lines += ["", "What moves each figure most (change from the baseline at the low end / the high end):", ""]
    for field, label, unit in FIGURES:
        rows = [(u, lo, hi) for f, u, lo, hi in tornado_rows(r) if f == field]
        rows.sort(key=lambda x: -max(abs(x[1] or 0.0), abs(x[2] or 0.0)))
        lines.append(f"- {label}: " + "; ".join(f"{u} {_delta(lo, unit)} / {_delta(hi, unit)}" for u, lo, hi in rows))
    return "\n".join(lines) + "\n"


def tornado_rows(r: SensitivityResult) -> list[tuple[str, str, float | None, float | None]]:
    """(figure, unknown, change at the low end, change at the high end) from the baseline."""
    out = []
    by_unknown: dict[str, list[VariantResult]] = {}
    for v in r.variants:
        by_unknown.setdefault(v.unknown, []).append(v)
    for field, _, _ in FIGURES:
        base = getattr(r.baseline.figures, field)
        for unknown, vs in by_unknown.items():
            ends = [getattr(v.figures, field) for v in vs[:2]]
            deltas = [None if e is None or base is None else e - base for e in ends] + [None, None]
            out.append((field, unknown, deltas[0], deltas[1]))
    return out
