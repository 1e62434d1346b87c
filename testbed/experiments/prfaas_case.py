"""Prefill-as-a-Service's case study beside the paper's figures (``make reproduce-prfaas``,
docs/results.md).

The case study compares three deployments of one 1 T hybrid model: PrfaaS (a 64-H20 PD
cluster that sends only long uncached prefills to a 32-H200 prefill cluster over a 100
Gbit/s line: ``topologies/prfaas.yaml`` with ``prefill-offload``), homogeneous PD (96 H20 in
one datacenter: ``prfaas-homogeneous.yaml`` with ``same-dc``) and naive heterogeneous PD
(every prefill on the H200s: ``prfaas-naive.yaml`` with ``prefill-offload``). A folder with
one load sweep of each (``prfaas/``, ``homogeneous/``, ``naive/``; one ``seed-<s>/`` per draw)
becomes ``prfaas.md``: each figure the paper states, ours per draw, and the mean with its
95 % interval over the draws. ``testbed report FOLDER`` rebuilds it from what was saved.

Read as the paper does: *throughput* is a deployment's SLA throughput (the highest load of
the sweep at which the objectives held, as requests per second); *at equal hardware cost*
divides it by the deployment's price (the scenario's ``costs``); the TTFT change compares
PrfaaS with homogeneous PD at homogeneous PD's own SLA load (the busiest load of both sweeps
at which homogeneous PD met the objectives);
the offloaded share and the line's use (its mean over the run, and its busiest bin of the
run's timeline) are PrfaaS's at its SLA load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.analysis.confidence import mean_ci
from testbed.analysis.results import load_run
from testbed.analysis.wan_line import byte_factor
from testbed.errors import InputError
from testbed.experiments.load_sweep import SWEEP_FILE, LoadPoint, SlaThroughput, SweepResult
from testbed.outputs import write_atomic

CASE_FILE = "prfaas.md"
TOLERANCE = 0.25  # how near the paper a figure must be (docs/results.md explains each miss)
DESIGNS = ("prfaas", "homogeneous", "naive")  # the folders, each one load sweep


@dataclass(frozen=True)
class Figure:
    name: str
    paper: float
    unit: str  # "x" (a ratio), "%" (a change or a share), "Gbit/s"


FIGURES = (
    Figure("throughput vs homogeneous PD", 1.54, "x"),
    Figure("throughput vs naive heterogeneous PD", 1.32, "x"),
    Figure("throughput per price vs homogeneous PD (equal hardware cost)", 1.15, "x"),
    Figure("mean TTFT vs homogeneous PD", -50.0, "%"),
    Figure("P90 TTFT vs homogeneous PD", -64.0, "%"),
    Figure("requests offloaded", 50.0, "%"),
    Figure("the line's use, mean over the run (PrfaaS to PD)", 13.0, "Gbit/s"),
    Figure("the line's use, busiest bin (PrfaaS to PD)", 13.0, "Gbit/s"),
)


def is_case(d: Path) -> bool:
    return all(_draws(d / name) for name in DESIGNS)


def _draws(d: Path) -> dict[int, Path]:
    """The sweep folder of each draw (one sweep alone is draw 0)."""
    if (d / SWEEP_FILE).exists():
        return {0: d}
    return {int(x.name.removeprefix("seed-")): x for x in d.glob("seed-*")
            if x.name.removeprefix("seed-").isdigit() and (x / SWEEP_FILE).exists()}


def _sweep(d: Path) -> SweepResult:
    return SweepResult.model_validate_json((d / SWEEP_FILE).read_text())


def _only(items: list[SlaThroughput], where: Path) -> SlaThroughput:
    if len(items) != 1:
        raise InputError(f"{where}: expected the sweep of one policy, found {len(items)}")
    return items[0]


def _point(r: SweepResult, load: float | None) -> LoadPoint | None:
    return next((p for p in r.points if load is not None and abs(p.load - load) < 1e-9), None)


def _run_dir(p: LoadPoint, sweep_dir: Path) -> Path:
    d = Path(p.run_dir)
    return d if d.is_dir() else sweep_dir / d.name  # a folder moved since: its run beside its sweep


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _change(a: float | None, b: float | None) -> float | None:
    return 100 * (a / b - 1) if a is not None and b else None


def draw_figures(folders: dict[str, Path]) -> list[float | None]:
    """The figures of ``FIGURES`` for one draw (None: not measurable, e.g. no SLA point)."""
    sweeps = {name: _sweep(d) for name, d in folders.items()}
    sla = {name: _only(r.sla, folders[name]) for name, r in sweeps.items()}
    ours, homo = sla["prfaas"], sla["homogeneous"]
    # The busiest load both swept at which homogeneous PD still met the objectives.
    both = {p.load for p in sweeps["prfaas"].points} & {p.load for p in sweeps["homogeneous"].points}
    common = max((x for x in both if homo.load is not None and x <= homo.load + 1e-9), default=None)
    at_homo = _point(sweeps["prfaas"], common), _point(sweeps["homogeneous"], common)
    mean_ttft: list[float | None] = [None, None]
    if all(at_homo):
        for i, (p, name) in enumerate(zip(at_homo, ("prfaas", "homogeneous"), strict=True)):
            assert p is not None
            summary, _ = load_run(_run_dir(p, folders[name]))
            mean_ttft[i] = summary.policies[p.policy].ttft_mean_s
    offloaded = mean = peak = None
    if (own := _point(sweeps["prfaas"], ours.load)) is not None:
        summary, _ = load_run(_run_dir(own, folders["prfaas"]))
        s = summary.policies[own.policy]
        counts = s.policy_stats.counts if s.policy_stats else {}
        offloaded = 100 * sum(v for k, v in counts.items() if k.startswith("offloaded")) / max(1, s.requests)
        back = [line for name, line in s.wan_line.items() if name.startswith("b")]  # toward the PD cluster
        if back and any(back[0].wire_bytes) and s.duration_s:
            mean = sum(back[0].wire_bytes) * byte_factor(summary) * 8 / s.duration_s / 1e9
            peak = max(back[0].wire_bytes) * byte_factor(summary) * 8 / back[0].bin_s / 1e9
    return [
        _ratio(ours.rps, homo.rps), _ratio(ours.rps, sla["naive"].rps), _ratio(ours.bcr, homo.bcr),
        _change(*mean_ttft), _change(at_homo[0].ttft_p90_s if at_homo[0] else None,
                                     at_homo[1].ttft_p90_s if at_homo[1] else None),
        offloaded, mean, peak,
    ]


def _near(v: float, f: Figure) -> bool:
    """Within ``TOLERANCE`` of the paper's figure; a ratio by its gain (1.01x is no +32 %)."""
    ours, theirs = (v - 1, f.paper - 1) if f.unit == "x" else (v, f.paper)
    return abs(ours - theirs) <= TOLERANCE * abs(theirs)


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" if unit == "x" else f"{v:+.0f} %" if unit == "%" and v < 0 else \
        f"{v:.0f} %" if unit == "%" else f"{v:.1f} {unit}"


def case_markdown(d: Path) -> str:
    draws = {name: _draws(d / name) for name in DESIGNS}
    seeds = sorted(set.intersection(*(set(x) for x in draws.values())))
    per_draw = {s: draw_figures({name: draws[name][s] for name in DESIGNS}) for s in seeds}
    first = _sweep(draws["prfaas"][seeds[0]])
    slas = {name: [_only(_sweep(draws[name][s]).sla, d / name) for s in seeds] for name in DESIGNS}
    lines = ["# Prefill-as-a-Service's case study, beside the paper", "",
             f"{len(seeds)} draw(s) of the workload; the objectives: {first.share:.0%} of requests with TTFT <= "
             f"{first.slo_ttft_s:g} s and TPOT <= {first.slo_tpot_s:g} s. Mean and 95 % interval over the draws.", "",
             "| figure | paper | this testbed | within +-25 % | per draw |", "|---|---:|---:|---|---|"]
    for i, f in enumerate(FIGURES):
        values = [per_draw[s][i] for s in seeds]
        ci = mean_ci([v for v in values if v is not None])
        shown = "-" if ci is None else _fmt(ci.mean, f.unit) + (f" ± {ci.half:.2g}" if ci.half is not None else "")
        near = "-" if ci is None else "yes" if _near(ci.mean, f) else "**no**"
        lines.append(f"| {f.name} | {_fmt(f.paper, f.unit)} | {shown} | {near} | "
                     f"{', '.join(_fmt(v, f.unit) for v in values)} |")
    lines += ["", "| deployment | SLA throughput, requests/s per draw | price | load (x the trace's rate) |",
              "|---|---|---:|---|"]
    for name in DESIGNS:
        ts = slas[name]
        lines.append(f"| {name} ({ts[0].policy}) | {', '.join('-' if t.rps is None else f'{t.rps:.3f}' for t in ts)}"
                     f" | {ts[0].cost if ts[0].cost is not None else '-'} | "
                     f"{', '.join('-' if t.load is None else f'{t.load:g}' for t in ts)} |")
    return "\n".join(lines) + "\n"


def write_case(d: Path) -> list[Path]:
    write_atomic(d / CASE_FILE, case_markdown(d))
    return [d / CASE_FILE]
