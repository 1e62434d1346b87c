"""``testbed bench scale`` (``make bench-scale``): how large a modeled cluster this host emulates, and how fast.

For each size (devices in total) the bench builds a deployment shaped like PDD's side of
``topologies/paper.yaml`` (prefill : relay : main decode devices as 40 : 3 : 32, instances of
at most 8 devices, the same devices, model, line and prices), generates an open-loop agentic
recipe whose request rate is a fixed ``per_device_rps`` times the devices (so every size
carries the same load per device), and replays it under ``pdd``: first at ``START_DILATION``
(twice faster than real time; ``--start-dilation``), and while the verdict fails again at
1.5x the dilation, up to ``MAX_ATTEMPTS`` replays (the whole replay is the probe: what
passes is what a run of this load holds). Per size it reports the lowest dilation of that ladder that passed,
emulated seconds per wall second over the replay, host CPU seconds per request (every
process of the run: workers, router, broker, delay line) and the delay line's share of
that CPU. The sizes climb their ladders in rounds (every size still climbing replays once a
round): one replay after another here, side by side with ``--executor ray``, one emulation
per node. Every replay is a run folder ``testbed report`` rebuilds; the table is saved as
``scale.json`` and ``scale.md``, and plotted in ``scale.png``, after every round.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

from testbed.analysis.results import load_run
from testbed.deploy.emulation import round_up
from testbed.errors import InputError
from testbed.experiments.parallel import Replay, run_all, saved
from testbed.experiments.trace_run import RunOptions
from testbed.outputs import atomic_path, write_atomic
from testbed.policies import parse_policy
from testbed.scenario import Role, Scenario, load_scenario
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate, write_jsonl
from testbed.traces.workload import Workload

SIZES = (4, 16, 32, 75, 150)
SHAPE = {Role.PREFILL: 40, Role.RELAY_DECODE: 3, Role.DECODE: 32}  # PDD's 75 devices in paper.yaml
PER_INSTANCE_MAX = 8
PER_DEVICE_RPS = 0.04  # 3 requests/s on 75 devices: >= 10,000 requests in an emulated hour
WINDOW_S = 30.0  # emulated seconds in which sessions start (their later turns run past it)
TOKEN_SCALE = 16
START_DILATION = 0.5
MAX_ATTEMPTS = 6  # 0.5, 0.75, 1.2, 1.7, 2.6, 3.9
RETRY_FACTOR = 1.5


@dataclass
class ScalePoint:
    """One size: what was asked, what passed, what it cost."""

    size: int  # devices asked for
    devices: int  # devices built (instances hold whole devices)
    instances: int
    requests: int
    completed: int
    dilation: float
    passed: bool
    attempts: list[str]  # "D 3: failed (reason)" per replay
    emulated_per_wall: float  # emulated seconds per wall second over the replay
    cpu_s: float  # host CPU of every process of the run
    cpu_per_request: float
    delayline_share: float  # of cpu_s
    wall_s: float  # the passing (or last) replay
    run_dir: str


def split(n: int) -> list[int]:
    """``n`` devices as the fewest instances of at most ``PER_INSTANCE_MAX``, as even as can be."""
    k = math.ceil(n / PER_INSTANCE_MAX)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def scaled_scenario(base: Scenario, size: int) -> Scenario:
    """PDD's side of ``base`` (``paper.yaml``) resized to ``size`` devices (at least one per role)."""
    (dc_a, a), (dc_b, b) = base.datacenters.items()
    home = {Role.PREFILL: (a, b), Role.RELAY_DECODE: (a, b), Role.DECODE: (b, a)}  # main decoders: b's devices
    device = {role: next(h.device for dc in home[role] for h in dc.hosts.values() if h.role == role) for role in SHAPE}
    relay = max(1, round(size * SHAPE[Role.RELAY_DECODE] / sum(SHAPE.values())))
    prefill = max(1, round((size - relay) * SHAPE[Role.PREFILL] / (SHAPE[Role.PREFILL] + SHAPE[Role.DECODE])))
    count = {Role.PREFILL: prefill, Role.RELAY_DECODE: relay, Role.DECODE: max(1, size - relay - prefill)}
    hosts_a: dict[str, Any] = {n: h.model_dump() for n, h in a.hosts.items() if h.role in (Role.CLIENT, Role.ROUTER)}
    hosts_b: dict[str, Any] = {}
    for role, name, hosts in ((Role.PREFILL, "prefill", hosts_a), (Role.RELAY_DECODE, "relay", hosts_a),
                              (Role.DECODE, "decode-b", hosts_b)):
        for i, n in enumerate(split(count[role]), 1):
            hosts[f"{name}{i}"] = {"role": role.value, "device": device[role], "devices": n, "compute": "modeled"}
    raw = base.model_dump(mode="json")
    raw["name"] = f"{base.name}-{size}"
    raw["description"] = f"{base.name} resized to {size} devices by testbed bench scale"
    raw["datacenters"][dc_a]["hosts"], raw["datacenters"][dc_b]["hosts"] = hosts_a, hosts_b
    return Scenario.model_validate(raw)


def devices_of(sc: Scenario) -> tuple[int, int]:
    """Devices and instances of the serving hosts."""
    hosts = [h for dc in sc.datacenters.values() for h in dc.hosts.values() if h.role in SHAPE]
    return sum(h.devices for h in hosts), len(hosts)


@dataclass
class Ladder:
    """One size's climb: its deployment and trace, the dilation to try next, what each try gave."""

    size: int
    sc: Scenario
    wl: Workload
    out: Path
    d: float
    attempts: list[str] = field(default_factory=list)
    point: ScalePoint | None = None  # set once the ladder ends

    @property
    def run_dir(self) -> Path:
        return self.out / f"devices-{self.size}" / f"D-{self.d:g}"


def ladder(sc: Scenario, size: int, out: Path, per_device_rps: float, window_s: float, seed: int,
           start_dilation: float) -> Ladder:
    """``size``'s deployment and its open-loop trace (saved beside its replays)."""
    devices, _ = devices_of(sc)
    trace = out / f"devices-{size}" / "trace.jsonl"
    sessions, header = generate(GenConfig(arrivals="open", rps=per_device_rps * devices, duration_s=window_s,
                                          turns_max=4, seed=seed, calibrate_scale=TOKEN_SCALE))
    write_jsonl(trace, sessions, header)
    return Ladder(size, sc, load_trace(trace, "sessions", TOKEN_SCALE), out, start_dilation)


def judge(lad: Ladder) -> None:
    """What the replay at ``lad.d`` gave: the size's point when it passed, lost its replay or
    tried ``MAX_ATTEMPTS`` times; else the next dilation up."""
    devices, instances = devices_of(lad.sc)
    run_dir = lad.run_dir
    if not saved([run_dir]):  # a cluster's replay that failed on every node it was sent to (named there)
        lad.attempts.append(f"D {lad.d:g}: no results (the replay was lost)")
        lad.point = ScalePoint(size=lad.size, devices=devices, instances=instances, requests=0, completed=0,
                               dilation=lad.d, passed=False, attempts=lad.attempts, emulated_per_wall=0.0, cpu_s=0.0,
                               cpu_per_request=0.0, delayline_share=0.0, wall_s=0.0, run_dir=str(run_dir))
        return
    summary, _ = load_run(run_dir)
    s = summary.policies["pdd"]
    v = s.fidelity
    ok = v.passed and s.failed == 0
    why = v.reasons[0] if v.reasons else f"{s.failed} requests failed"
    lad.attempts.append(f"D {lad.d:g}: " + ("passed" if ok else f"failed ({why})"))
    if not ok and len(lad.attempts) < MAX_ATTEMPTS:
        lad.d = round_up(lad.d * RETRY_FACTOR)
        return
    cpu = sum(c.cpu_s for c in v.cpu.values())
    wall = max((c.cpu_s / c.share for c in v.cpu.values() if c.share > 0), default=0.0)
    line = v.cpu.get("delayline")
    lad.point = ScalePoint(size=lad.size, devices=devices, instances=instances, requests=s.requests,
                           completed=s.completed, dilation=lad.d, passed=ok, attempts=lad.attempts,
                           emulated_per_wall=round((s.duration_s or 0.0) / wall, 3) if wall else 0.0,
                           cpu_s=round(cpu, 1), cpu_per_request=round(cpu / max(1, s.requests), 3),
                           delayline_share=round(line.cpu_s / cpu, 3) if line and cpu else 0.0,
                           wall_s=round(wall, 1), run_dir=str(run_dir))


def table(points: list[ScalePoint]) -> str:
    lines = ["| devices asked | devices (instances) | requests | dilation | verdict | emulated s per wall s | "
             "host CPU-s per request | delay line share of CPU | replay wall |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.size} | {p.devices} ({p.instances}) | {p.completed}/{p.requests} | {p.dilation:g} | "
                     f"{'passed' if p.passed else 'FAILED'} | {p.emulated_per_wall:.2f} | {p.cpu_per_request:.2f} | "
                     f"{100 * p.delayline_share:.0f} % | {p.wall_s:.0f} s |")
    return "\n".join(lines)


def plot(points: list[ScalePoint], path: Path, rps: float, start_dilation: float = START_DILATION) -> None:
    x = [p.devices for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, ys, label in ((axes[0], [p.dilation for p in points], "dilation D (real s per emulated s)"),
                          (axes[1], [p.cpu_per_request for p in points], "host CPU-s per request"),
                          (axes[2], [100 * p.delayline_share for p in points], "delay line, % of host CPU")):
        ax.plot(x, ys, "o-")
        for p, y in zip(points, ys, strict=True):
            if not p.passed:
                ax.plot([p.devices], [y], "rx", markersize=10)
        ax.set_xscale("log")
        ax.set_xlabel("modeled devices")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_ylim(bottom=0)
    fig.suptitle(f"bench scale: paper.yaml-shaped PDD, {rps:g} req/s per device, open loop; dilations tried from "
                 f"{start_dilation:g} up (red x: none passed)", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def run_bench(scenario: Path, sizes: list[int], out: Path, per_device_rps: float = PER_DEVICE_RPS,
              window_s: float = WINDOW_S, seed: int = 1, start_dilation: float = START_DILATION,
              executor: Literal["local", "ray"] = "local", ray_address: str | None = None, ray_retries: int = 2) -> int:
    """Every size's ladder, climbed in rounds: each round replays every size still climbing at
    its next dilation, one after another here, side by side with ``--executor ray`` (one
    emulation per node, ``experiments/ray_executor.py``); the table is saved after each round."""
    if not sizes or min(sizes) < 3:
        raise InputError("--sizes: at least 3 devices each (one prefill, one relay, one main decoder)")
    if per_device_rps <= 0 or window_s <= 0 or start_dilation <= 0:
        raise InputError("--per-device-rps, --window and --start-dilation must be > 0")
    base = load_scenario(scenario)
    if not all(base.hosts_with_role(r) for r in SHAPE):
        raise InputError(f"{scenario}: bench scale needs a PDD scenario (prefill, relay-decode and decode hosts)")
    ladders = [ladder(scaled_scenario(base, size), size, out, per_device_rps, window_s, seed, start_dilation)
               for size in sizes]
    t0 = time.monotonic()
    md = ""
    for round_no in range(1, MAX_ATTEMPTS + 1):
        climbing = [lad for lad in ladders if lad.point is None]
        if not climbing:
            break
        print(f"\n=== bench scale, round {round_no}: " + ", ".join(
            f"{lad.size} devices ({devices_of(lad.sc)[1]} instances) at D {lad.d:g}" for lad in climbing)
              + f" [{time.monotonic() - t0:.0f} s]", flush=True)
        opts = RunOptions(allow_infidelity=True, executor=executor, ray_address=ray_address, ray_retries=ray_retries)
        run_all([Replay(lad.sc, lad.wl, [parse_policy("pdd")], replace(opts, dilation=lad.d, out=lad.run_dir))
                 for lad in climbing])
        for lad in climbing:
            judge(lad)
        points = [lad.point for lad in ladders if lad.point is not None]
        write_atomic(out / "scale.json", _json(points, scenario, per_device_rps, window_s))
        md = table(points)
        write_atomic(out / "scale.md", md + "\n")
        plot(points, out / "scale.png", per_device_rps, start_dilation)
    print(f"\nbench scale ({scenario}, pdd, {per_device_rps:g} req/s per device, sessions starting over "
          f"{window_s:g} emulated s, token scale {TOKEN_SCALE}, executor {executor}) [{time.monotonic() - t0:.0f} s]")
    print(md)
    print(f"\nsaved: {out / 'scale.md'}, {out / 'scale.json'}, {out / 'scale.png'}")
    return 0 if all(lad.point is not None and lad.point.passed for lad in ladders) else 1


def _json(points: list[ScalePoint], scenario: Path, rps: float, window_s: float) -> str:
    return json.dumps({"scenario": str(scenario), "policy": "pdd", "per_device_rps": rps, "window_s": window_s,
                       "token_scale": TOKEN_SCALE, "points": [asdict(p) for p in points]}, indent=2)
