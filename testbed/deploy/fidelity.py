"""The fidelity verdict of a run: did the host keep up with what it emulated?

Per worker: paced steps, the fraction that overran their modeled time and by how much in
all; per WAN direction: delay-line frames, drops by cause and lateness percentiles
(measured from the kernel's receive timestamp); per process: CPU seconds and share of the
run's wall time. A run FAILS when any worker overran more than ``MAX_SHARE_PCT`` % of
its steps or more than 1 % of a WAN direction's frames arrive late, judged in emulated time
(lateness over ``LATE_SHARE_OF_DELAY`` of the direction's delay, and never under
``MAX_LATE_US`` of real time, the host's timer noise): its latencies would then measure this
host, not the emulated datacenters. Both are judged as counts: at most 1 % of the steps
(frames) may overrun (arrive late), rounded up to a whole one, and ``LATE_FRAMES_FREE`` frames
at least. A P99 taken by rank from fewer than 100 values is their maximum, so a direction
carrying 78 control frames would otherwise be judged on its single worst frame while one
carrying 1,500 is judged on its 16th worst. A worker on the
``native`` device is the host CPU, not an emulated device: reported, never judged.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from protocol.worker_config import (
    LATE_WAKE,
    LATE_WAKE_FLOOR_S,
    NEED_MIN_BUCKET,
    NEED_STEP,
    WorkerStats,
    WorstOverrun,
)
from testbed.engines import kind
from testbed.net.delayline_contract import LATE_EDGES_US, DelayLineReport

MAX_SHARE_PCT = 1  # of a worker's steps that may overrun, of a direction's frames that may be late
MAX_LATE_US = 1000.0
# A frame is late when its lateness in emulated time (the wire's divided by D) is more than
# this share of the direction's emulated delay, i.e. the wire's lateness more than this share of
# the wire's delay (D x the emulated one), and never less than MAX_LATE_US (the host's timer
# noise): at D 6 on a 15 ms line, 5 of 226 frames 1.07 ms late (0.18 ms emulated) failed a run
# that was faithful. Counted by the histogram's edges, rounded down (an edge at or below).
LATE_SHARE_OF_DELAY = 0.05
# However few frames a direction carried, this many may be late (a handful cannot fail a run).
LATE_FRAMES_FREE = 5
CLK_TCK = os.sysconf("SC_CLK_TCK")
STEAL_NOTE_SHARE = 0.02  # a failed verdict names the hypervisor above this share of CPU time


def host_steal_s() -> float:
    """CPU seconds this machine's hypervisor has taken from it since boot (all CPUs; 0 where
    the kernel accounts none): a virtual machine whose CPUs were handed to another guest
    ran late however idle it looked from inside."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / CLK_TCK if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerFidelity(_Record):
    """One worker's pacing: how many steps overran their modeled time, by kind, and the worst."""

    device: str
    native: bool
    compute: str
    steps: int
    overruns: int
    overrun_fraction: float
    overrun_s: float
    by_kind: dict[str, tuple[int, int]] = {}  # kind -> (steps, overruns)
    worst: list[WorstOverrun] = []
    late_wakes: int = 0  # steps whose work fit but which ended late (``workers/device.py``)
    late_s: float = 0.0
    late_max_s: float = 0.0
    need: float | None = None  # the share of this run's dilation its steps would have kept up at (``need_factor``)


class LinkFidelity(_Record):
    """One WAN direction of the delay line: frames, drops by cause, lateness (microseconds)."""

    frames_out: int
    drop_loss: int
    drop_queue_full: int
    drop_overflow: int
    drop_error: int
    late_p50_us: float
    late_p99_us: float
    late_max_us: float


class CpuShare(_Record):
    cpu_s: float
    share: float  # of the run's wall time


class Verdict(_Record):
    """Saved with every policy's summary; ``format_verdict`` prints it the same from a live run
    or a saved one."""

    passed: bool = True
    reasons: list[str] = []
    workers: dict[str, WorkerFidelity] = {}
    links: dict[str, LinkFidelity] = {}
    cpu: dict[str, CpuShare] = {}
    host_steal_s: float = 0.0  # CPU seconds the hypervisor took from this machine during the run
    host_steal_share: float = 0.0  # of all its CPUs' time over the run
    # The share of this run's dilation at which every worker's steps would still have passed
    # (the largest worker's ``need``; None: nothing paced): what ``dilation auto`` learns from.
    need: float | None = None


def allowed(n: int) -> int:
    """How many of ``n`` steps or frames may overrun or arrive late: 1 %, rounded up."""
    return (n * MAX_SHARE_PCT + 99) // 100


def need_factor(needs: dict[int, int], steps: int) -> float | None:
    """The smallest share ``f`` of the run's dilation at which no more than ``allowed(steps)``
    of these steps would have overrun or ended late, each taking the real time it took here
    (``DeviceReport.needs``, in buckets of ``NEED_STEP``; rounded up to a bucket's edge). A
    lower dilation runs the same work in less wall time, so the host is busier: a floor to
    confirm by a run, not a promise. None when no step was counted."""
    if not needs:
        return None
    left = allowed(steps)
    for k in sorted(needs, reverse=True):
        if needs[k] > left:
            return NEED_STEP**k
        left -= needs[k]
    return NEED_STEP**NEED_MIN_BUCKET


def late_threshold_us(delay_ms: float | None) -> float:
    """The lateness (real microseconds, a histogram edge) from which a frame of a direction
    with this wire delay counts as late: ``LATE_SHARE_OF_DELAY`` of it, at least ``MAX_LATE_US``."""
    want = max(MAX_LATE_US, LATE_SHARE_OF_DELAY * 1000 * (delay_ms or 0.0))
    return float(max(e for e in LATE_EDGES_US if e <= want))


def allowed_frames(n: int) -> int:
    """How many of a direction's ``n`` frames may arrive late: 1 % rounded up, a handful at least."""
    return max(allowed(n), LATE_FRAMES_FREE)


def judge(workers: dict[str, WorkerStats], delayline: DelayLineReport | None, cpu: dict[str, float],
          wall_s: float, steal_s: float = 0.0, delays_ms: dict[str, float] | None = None) -> Verdict:
    """The verdict (module docstring); ``delays_ms``: each WAN direction's wire delay (its
    frames' lateness is judged against it: ``late_threshold_us``)."""
    v = Verdict(host_steal_s=round(steal_s, 2),
                host_steal_share=round(steal_s / (wall_s * (os.cpu_count() or 1)), 4) if wall_s > 0 else 0.0)
    for name, st in sorted(workers.items()):
        d = st.device
        v.workers[name] = WorkerFidelity(
            device=d.device, native=d.native, compute=st.compute, steps=d.steps, overruns=d.overruns,
            overrun_fraction=d.overrun_fraction, overrun_s=d.overrun_s, by_kind=d.by_kind, worst=d.worst,
            late_wakes=d.late_wakes, late_s=d.late_s, late_max_s=d.late_max_s,
            need=None if d.native else need_factor(d.needs, d.steps))
        need = v.workers[name].need
        if need is not None:
            v.need = max(v.need or 0.0, need)
        # A step whose work fit but whose end came late lasted longer than modeled all the same.
        if not d.native and d.overruns + d.late_wakes > allowed(d.steps):
            v.passed = False
            if d.overruns:
                kinds = ", ".join(f"{k} {o}/{n}" for k, (n, o) in d.by_kind.items() if o)
                v.reasons.append(f"{name} overran {100 * d.overrun_fraction:.1f}% of its steps "
                                 f"({d.overruns}/{d.steps}: {kinds}; {d.overrun_s:.2f} s in all)")
            if d.late_wakes:
                v.reasons.append(f"{name}: {d.late_wakes} of {d.steps} steps ended more than "
                                 f"{100 * LATE_WAKE:g}% of their modeled time (and {1000 * LATE_WAKE_FLOOR_S:g} ms) "
                                 f"late (the wait for their end woke late; up to {1000 * d.late_max_s:.1f} ms)")
    if delayline is not None:
        for name, d in delayline.directions.items():
            v.links[name] = LinkFidelity(**{f: getattr(d, f) for f in LinkFidelity.model_fields})
            edge = late_threshold_us((delays_ms or {}).get(name))
            late, frames = sum(d.late_hist[LATE_EDGES_US.index(int(edge)) + 1 :]), sum(d.late_hist)
            if late > allowed_frames(frames):
                v.passed = False
                v.reasons.append(f"delay line {name}: {late} of {frames} frames more than "
                                 f"{edge / 1000:g} ms late (lateness P99 <= {d.late_p99_us / 1000:g} ms; "
                                 f"allowed {allowed_frames(frames)}: 1 %, rounded up, {LATE_FRAMES_FREE} at least)")
    for name, secs in sorted(cpu.items()):
        v.cpu[name] = CpuShare(cpu_s=round(secs, 2), share=round(secs / wall_s, 3) if wall_s > 0 else 0.0)
    return v


def format_verdict(label: str, v: Verdict, engine: str = "emulation") -> str:
    if kind(engine).virtual_time and v.passed:  # each step lasted its modeled time: a block of zeros would say nothing
        cpu = sum(c.cpu_s for c in v.cpu.values())
        return (f"fidelity {label}: nothing to judge in virtual time ({sum(w.steps for w in v.workers.values())} "
                f"steps, each as long as modeled; simulator CPU {cpu:.2f} s)")
    lines = [f"fidelity {label}: {'passed' if v.passed else 'FAILED'}"]
    lines += [f"  FAILED: {r}" for r in v.reasons]
    for name, w in v.workers.items():
        if w.native:
            lines.append(f"  {name:10} host CPU, not an emulated device ({w.steps} steps)")
        else:
            lines.append(f"  {name:10} {w.device:8} {w.compute:7} {w.steps:6} steps, overruns {w.overruns} "
                         f"({100 * w.overrun_fraction:.2f}%), {w.overrun_s:.2f} s over, ended late "
                         f"{w.late_wakes} (max {1000 * w.late_max_s:.1f} ms)")
            for o in w.worst[:3]:
                lines.append(f"      {o.kind} {1000 * (o.real_s - o.modeled_s):.0f} ms over "
                             f"({1000 * o.real_s:.0f} vs {1000 * o.modeled_s:.0f} ms; {o.detail})")
    for name, d in v.links.items():
        drops = d.drop_loss + d.drop_queue_full + d.drop_overflow + d.drop_error
        lines.append(f"  wan {name}: {d.frames_out} frames, {drops} dropped (loss {d.drop_loss}, "
                     f"queue {d.drop_queue_full + d.drop_overflow}), lateness p50 <= "
                     f"{d.late_p50_us / 1000:g} ms, p99 <= {d.late_p99_us / 1000:g} ms, "
                     f"max {d.late_max_us / 1000:.2f} ms")
    if v.cpu:
        lines.append("  CPU: " + ", ".join(f"{n} {c.cpu_s:.2f} s ({100 * c.share:.0f}%)" for n, c in v.cpu.items()))
    if v.need is not None:
        lines.append(f"  steps: would have passed down to {v.need:.2f} x this dilation, each taking the real time it "
                     "took here (a lower dilation keeps the host busier: to confirm by a run)")
    if v.host_steal_s > 0:
        lines.append(f"  host: its hypervisor took {v.host_steal_s:.1f} CPU-s from this machine during the run "
                     f"(steal, {100 * v.host_steal_share:.1f}% of its CPU time)")
        if not v.passed and v.host_steal_share >= STEAL_NOTE_SHARE:
            lines.append("  host: CPUs taken away from this virtual machine delay every process alike; "
                         "a rerun on a quieter host may pass where a higher dilation would only slow it")
    return "\n".join(lines)
