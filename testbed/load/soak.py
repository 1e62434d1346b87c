"""``testbed soak``: a long replay under a random fault every minute, to find what only time
finds: a request that never ends, one that vanishes, a process whose memory grows.

The workload is the trace repeated back to back (each copy's request ids prefixed ``cK-``)
at ``load`` times its rate, for ``minutes`` of emulated time (``minutes x D`` of wall
clock); a fault of a random kind (``random_faults``: every kind of
``testbed.faults.timeline``, a killed worker started again after a few seconds, so the
cluster lives on) lands every ``fault_every_s`` emulated seconds: the fault rate the
emulated system meets is the same at any dilation.
Every process of the run has its resident memory sampled (``RssSampler``). The verdict:
every request *completed* or *failed with a reason*; *hung* (no end within the client's
bound) and *lost* (sent, yet unknown to the router and never finished) must both be 0; the
cluster serves again after the last fault; and every process that lived through at least half
the soak kept its resident memory flat: within 10 % over the second half of its life (the first
half is where bounded queues reach their depth; a leak keeps growing). Workers are judged on
their floor, RSS net of the KV they hold (caches, sequences, the decode batch) at each
minute's lowest (``workers.allocator``), which neither a cache still filling nor a burst of
work raises.
Saved: ``soak.json`` (a ``SoakReport``), ``requests.csv``, ``rss.csv`` and ``rss.png``.
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from pydantic import BaseModel

from testbed.analysis.plots import plot_rss
from testbed.analysis.results import write_csv
from testbed.deploy.deployment import Deployment
from testbed.deploy.dilation import emulation_plan
from testbed.deploy.process_sampling import ProcessMemory, with_floor
from testbed.deploy.run_record import ClientRecord
from testbed.errors import InputError
from testbed.faults.timeline import AppliedFault, Fault
from testbed.load.retry import SOAK_RETRY, RetryPolicy
from testbed.load.trace_replay import TraceReplay, probe_replay
from testbed.outputs import new_run_dir, write_atomic
from testbed.policies import parse_policy
from testbed.scenario import Role, Scenario
from testbed.traces.workload import RequestSpec, Workload

FAULT_KINDS = ("wan-down", "loss", "delay", "rate", "partition", "kill", "broker-restart")
WAN_DOWN_S = (4.0, 8.0, 15.0, 30.0)  # emulated seconds a wan-down lasts; other faults 2, 4 or 8


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 30.0  # emulated minutes of replay (wall: x the dilation)
    # Times the trace's own session-start rate, copies back to back. A trace's sessions start
    # in a burst (the default's 32 sessions in 24 s) and their turns run long after it: at 1.5
    # the default trace offered ~7 requests per emulated second, about 6x the 1.2 that one
    # replay of it averages in `make run-trace` (117 requests in ~99 emulated s), and a
    # 30-minute soak never drained. 0.4 offers ~1.9 (117 requests every 61 emulated s), about
    # 1.6x that average: a cluster under steady load above the default run's, not a flood.
    load: float = 0.4
    policy: str = "pdd"
    fault_every_s: float = 60.0  # emulated seconds
    seed: int = 1
    dilation: float | str | None = None  # None: the scenario's
    out: Path | None = None
    retry: RetryPolicy = SOAK_RETRY


class SoakReport(BaseModel):
    minutes: float  # emulated
    load: float
    policy: str
    dilation: float
    requests: int
    completed: int
    failed: int
    hung: int
    lost: int
    # Attempts that failed and were sent again (a session goes on when a retry succeeds), and
    # their share of all attempts; requests that completed only thanks to a retry.
    failed_attempts: int = 0
    retry_share: float = 0.0
    rescued_by_retry: int = 0
    failures_by_reason: dict[str, int]
    # The fault that cost each failed request: the faults in effect while it (or the earlier
    # turn whose failure ended its session) lived, or "no fault".
    failures_by_fault: dict[str, int] = {}
    retried_by_reason: dict[str, int] = {}
    faults: list[AppliedFault]
    faults_by_kind: dict[str, int]  # applied without error
    memory: list[ProcessMemory]
    # Requests sent after the last fault had cleared, and how many of them completed: the
    # cluster must serve again once the faults are over.
    after_faults_sent: int = 0
    after_faults_completed: int = 0
    fault_every_s: float = 0.0  # emulated seconds between faults

    @property
    def faults_per_minute(self) -> float:
        """Faults per emulated minute, as scheduled."""
        return 60.0 / self.fault_every_s if self.fault_every_s else 0.0

    @property
    def recovered(self) -> bool:
        return self.after_faults_sent == 0 or self.after_faults_completed > 0

    @property
    def grew(self) -> list[ProcessMemory]:
        """Processes that lived through at least half the soak and whose memory did not stay flat
        (``ProcessMemory.flat``); a worker restarted late is too young to judge."""
        return [m for m in self.memory if m.settled_s >= 30 * self.minutes * self.dilation and not m.flat()]

    @property
    def failed_share(self) -> float:
        return self.failed / max(1, self.requests)

    @property
    def passed(self) -> bool:
        return self.hung == 0 and self.lost == 0 and self.recovered and not self.grew


def soak_specs(wl: Workload, wall_s: float, load: float, dilation: float) -> list[RequestSpec]:
    """The trace's requests repeated back to back until ``wall_s`` of replay (times in real
    seconds at ``load`` x the trace's rate, stretched by the dilation)."""
    base = wl.specs(load / dilation)
    span = max((s.at for s in base if s.after is None), default=0.0) + 1.0
    out: list[RequestSpec] = []
    for k in range(int(wall_s // span) + 1):
        p = f"c{k}-"
        out += [replace(s, rid=p + s.rid, at=s.at + k * span, after=None if s.after is None else p + s.after,
                        also_after=tuple(p + a for a in s.also_after)) for s in base]
    kept = {s.rid for s in out if s.after is None and s.at < wall_s}
    grew = True
    while grew:  # the later turns of every session whose first turn is in
        new = {s.rid for s in out if s.after in kept} - kept
        kept |= new
        grew = bool(new)
    return [replace(s, also_after=tuple(a for a in s.also_after if a in kept)) for s in out if s.rid in kept]


def random_faults(sc: Scenario, emulated_s: float, every_s: float, seed: int) -> list[Fault]:
    """One fault of a random kind every ``every_s`` emulated seconds (the first after one
    period), lasting a few emulated seconds (a wan-down up to 30)."""
    rng = random.Random(seed)
    a, b = sc.wan.between
    workers = sorted(h for dc in sc.datacenters.values() for h, spec in dc.hosts.items()
                     if spec.role in (Role.PREFILL, Role.DECODE, Role.RELAY_DECODE, Role.COLOCATED))
    shaped = [d for d, w in ((f"{a}->{b}", sc.wan.forward), (f"{b}->{a}", sc.wan.reverse)) if w.rate_mbit]
    out = []
    t = every_s
    while t < emulated_s:
        at = round(t, 2)
        kind = rng.choice(FAULT_KINDS)
        if kind == "rate" and not shaped:
            kind = "loss"
        fields: dict[str, object] = {"kind": kind, "at_s": at, "duration_s": rng.choice([2.0, 4.0, 8.0])}
        if kind in ("wan-down", "loss", "delay"):
            fields["dir"] = rng.choice(["both", f"{a}->{b}", f"{b}->{a}"])
        if kind == "wan-down":  # a line's outage lasts up to 30 s (the PD outage's transfers outlive it)
            fields["duration_s"] = rng.choice(WAN_DOWN_S)
        if kind == "loss":
            fields["pct"] = rng.choice([1.0, 5.0, 20.0])
        elif kind == "delay":
            fields["ms"] = rng.choice([20.0, 100.0, 500.0])
        elif kind == "rate":
            fields["dir"] = rng.choice(shaped)
            wan = sc.wan.forward if fields["dir"] == f"{a}->{b}" else sc.wan.reverse
            fields["mbit"] = (wan.rate_mbit or 0) / rng.choice([2, 4, 10])
        elif kind == "partition":
            fields["dc"] = b
        elif kind == "kill":
            fields["host"] = rng.choice(workers)
        elif kind == "broker-restart":
            fields["duration_s"] = rng.choice([0.5, 1.0, 2.0])
        out.append(Fault.model_validate(fields))
        t += every_s
    return out


class SoakLoop(TraceReplay):
    """The trace repeated back to back for the soak's wall time, with every process's
    resident memory sampled while it runs."""

    samples_memory = True

    def __init__(self, wl: Workload, wall_s: float, load: float, dilation: float, timeout_s: float,
                 retry: RetryPolicy) -> None:
        super().__init__(soak_specs(wl, wall_s, load, dilation), timeout_s, "soak", retry=retry)


def _reason_kind(why: str) -> str:
    """A failure reason without its request-specific parts (ids, numbers, addresses)."""
    why = re.sub(r"\(during fault [^)]*\)", "(during a fault)", why)
    why = re.sub(r"\b[\w.-]*c\d+-[\w.:-]+", "<rid>", why)
    return re.sub(r"\d+(\.\d+)?", "N", why)[:120]


NO_FAULT = "no fault"


def costly_faults(recs: dict[str, ClientRecord], specs: list[RequestSpec], applied: list[AppliedFault],
                  t0_stamp: float, dilation: float) -> dict[str, str]:
    """Each failed request's fault: those in effect between its sending and its end (emulated
    seconds of the fault clock), or, for a turn never sent because an earlier one of its
    session failed, that turn's; ``NO_FAULT`` when none was."""
    after = {s.rid: s.after for s in specs}
    own: dict[str, str] = {}
    for rid, r in recs.items():
        if r.ok or not r.sent:
            continue
        start, end = (r.sent - t0_stamp) / dilation, ((r.ended or r.sent) - t0_stamp) / dilation
        own[rid] = ", ".join(f.fault for f in applied if f.active_between(start, end)) or NO_FAULT
    out = {}
    for rid, r in recs.items():
        if r.ok:
            continue
        cause, seen = rid, set()
        while cause not in own and after.get(cause) is not None and cause not in seen:
            seen.add(cause)
            cause = after[cause]  # type: ignore[assignment]
        out[rid] = own.get(cause, NO_FAULT)
    return out


def run_soak(sc: Scenario, wl: Workload, opts: SoakOptions) -> int:
    """The soak (see the module docstring). Exit code 0 when nothing hung and nothing was lost."""
    for name, value in (("--minutes", opts.minutes), ("--load", opts.load), ("--fault-every", opts.fault_every_s)):
        if value <= 0:
            raise InputError(f"{name}: must be positive, got {value}")
    spec = parse_policy(opts.policy)  # one policy; a bad one exits 2 naming it, before anything starts
    plan = emulation_plan(sc, wl, wl.specs(opts.load), opts.dilation, replay=probe_replay)
    d = plan.dilation
    emulated_s = opts.minutes * 60
    wall_s = emulated_s * d
    timeout_s = wall_s + 4 * sc.workers.request_timeout_s * d  # the bound every request must end within
    load = SoakLoop(wl, wall_s, opts.load, d, timeout_s, opts.retry)
    faults = random_faults(sc, emulated_s, opts.fault_every_s, opts.seed)
    out = opts.out or new_run_dir("soak")
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: {len(load.specs)} requests over {opts.minutes:g} emulated min ({wall_s / 60:.1f} min of wall clock "
          f"at D = {d:g}) at {opts.load:g}x the trace's rate, policy {spec.label}, a fault every "
          f"{opts.fault_every_s:g} emulated s ({len(faults)})", flush=True)
    with Deployment(sc, spec, emulation=plan, timeline=faults) as dep:
        run = dep.run(load)
    recs, router, applied = run.recs, run.router, run.faults
    # The workers' final statistics carry their floors to the end (the sampler read them up to
    # its last period); the router's came with its last report.
    final = {w.memory.pid: w.memory.floor for w in run.workers.values() if w.memory is not None}
    memory = [with_floor(m, final[m.pid]) if m.pid in final else m for m in run.memory]
    hung = [r for r in recs.values() if (r.error or "").startswith("no completion within the client timeout")]
    lost = [r for r in recs.values() if r.sent and r.last_rid not in router and not r.ok]
    retried = [a for r in recs.values() for a in r.retried]
    last_clear = max((f.cleared_s or f.applied_s or 0.0 for f in applied), default=0.0)
    after = [r for r in recs.values() if r.sent and (r.sent - run.fault_t0) / d > last_clear]
    cost = costly_faults(recs, load.specs, applied, run.fault_t0, d)
    report = SoakReport(
        minutes=opts.minutes, load=opts.load, policy=spec.label, dilation=d, requests=len(recs),
        completed=sum(r.ok for r in recs.values()), failed=sum(not r.ok for r in recs.values()),
        hung=len(hung), lost=len(lost), failed_attempts=len(retried),
        retry_share=len(retried) / max(1, len(retried) + sum(1 for r in recs.values() if r.sent)),
        rescued_by_retry=sum(1 for r in recs.values() if r.ok and r.retried),
        failures_by_reason=dict(Counter(_reason_kind(r.error) for r in recs.values() if r.error).most_common()),
        failures_by_fault=dict(Counter(cost.values()).most_common()),
        retried_by_reason=dict(Counter(_reason_kind(a.error) for a in retried).most_common()),
        faults=applied,
        faults_by_kind=dict(Counter(f.kind for f in applied if f.applied_s is not None and not f.error)),
        memory=memory, after_faults_sent=len(after), after_faults_completed=sum(r.ok for r in after),
        fault_every_s=opts.fault_every_s,
    )  # fmt: skip
    write_atomic(out / "soak.json", report.model_dump_json(indent=2))
    write_csv(pd.DataFrame([{"rid": r.rid, "ok": r.ok, "error": r.error, "sent": r.sent, "ended": r.ended,
                             "tokens": len(r.tokens), "max_new": r.max_new, "attempts": 1 + len(r.retried),
                             "fault": cost.get(r.rid),
                             "retried_errors": " | ".join(a.error for a in r.retried)} for r in recs.values()]),
              out / "requests.csv")
    rss = pd.DataFrame(run.rss, columns=["t_s", "process", "pid", "rss_mb"])
    write_csv(rss, out / "rss.csv")
    plot_rss(rss, out / "rss.png")
    print(format_soak(report))
    print(f"saved: {out}/soak.json, requests.csv, rss.csv, rss.png")
    if not report.passed:
        print(f"soak FAILED: {report.hung} hung, {report.lost} lost, "
              f"{report.after_faults_completed}/{report.after_faults_sent} completed after the last fault, "
              f"{len(report.grew)} processes grew",
              file=sys.stderr)
        return 1
    return 0


def format_soak(r: SoakReport) -> str:
    lines = [f"requests {r.requests}: completed {r.completed}, failed with a reason {r.failed} "
             f"({100 * r.failed_share:.1f} % after retries), hung {r.hung}, lost {r.lost}",
             f"{r.minutes:g} emulated minutes at D {r.dilation:g}, a fault every {r.fault_every_s:g} emulated s "
             f"({r.faults_per_minute:.2g} per emulated minute); faults applied: "
             + (", ".join(f"{k} {n}" for k, n in sorted(r.faults_by_kind.items())) or "none"),
             f"after the last fault cleared: {r.after_faults_completed} of {r.after_faults_sent} requests sent "
             "completed",
             f"retries: {r.failed_attempts} failed attempts sent again ({100 * r.retry_share:.1f} % of attempts), "
             f"{r.rescued_by_retry} requests completed thanks to one"]
    lines += [f"  failed {n:5d}  {why}" for why, n in list(r.failures_by_reason.items())[:12]]
    lines += [f"  failed {n:5d}  cost by {fault}" for fault, n in r.failures_by_fault.items()]
    lines += [f"  retried {n:5d}  {why}" for why, n in list(r.retried_by_reason.items())[:8]]
    lines.append(f"{'process':28s} {'pid':>7s} {'peak MB':>8s} {'first MB':>9s} {'last MB':>8s} {'growth':>7s} "
                 f"{'2nd half':>8s}")
    lines += [f"{m.name:28s} {m.pid:7d} {m.rss_peak_mb:8.1f} {m.rss_first_mb:9.1f} {m.rss_last_mb:8.1f} "
              f"{m.growth_mb:+7.1f} {m.late_growth_mb:+8.1f}{'  floor ' if m.judged_on_floor else ''}"
              + (f"{m.floor_first_mb:.0f} -> {m.floor_second_mb:.0f}" if m.judged_on_floor else "")
              for m in r.memory]
    grew = ", ".join(f"{m.name} ({m.pid}) {m.late_growth_mb:+.0f} MB" for m in r.grew)
    lines.append(f"memory: {'grew: ' + grew if grew else 'flat'} (processes that lived through half the soak: "
                 "within 10 % over the second half of their life; workers and the router on their floor, RSS "
                 "net of the KV or index they hold at each minute's lowest)")
    return "\n".join(lines)
