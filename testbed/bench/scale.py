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
that CPU. Every replay is a run folder ``testbed report`` rebuilds; the table is saved as
``scale.json`` and ``scale.md``, and plotted in ``scale.png``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

from testbed.analysis.results import load_run
from testbed.deploy.emulation import round_up
from testbed.errors import InputError
from testbed.experiments.trace_run import RunOptions, run_trace
from testbed.outputs import atomic_path, write_atomic
from testbed.policies.spec import parse_policy
from testbed.scenario import Role, Scenario, load_scenario
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate, write_jsonl

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


def measure(sc: Scenario, size: int, out: Path, per_device_rps: float, window_s: float, seed: int,
            start_dilation: float = START_DILATION) -> ScalePoint:
    devices, instances = devices_of(sc)
    trace = out / f"devices-{size}" / "trace.jsonl"
    sessions, header = generate(GenConfig(arrivals="open", rps=per_device_rps * devices, duration_s=window_s,
                                          turns_max=4, seed=seed, calibrate_scale=TOKEN_SCALE))
    write_jsonl(trace, sessions, header)
    wl = load_trace(trace, "sessions", TOKEN_SCALE)
    d = start_dilation
    attempts: list[str] = []
    while True:
        run_dir = out / f"devices-{size}" / f"D-{d:g}"
        run_trace(sc, wl, [parse_policy("pdd")], RunOptions(dilation=d, out=run_dir, allow_infidelity=True))
        summary, _ = load_run(run_dir)
        s = summary.policies["pdd"]
        v = s.fidelity
        ok = v.passed and s.failed == 0
        attempts.append(f"D {d:g}: " + ("passed" if ok else "failed (" + (v.reasons[0] if v.reasons
                                                                           else f"{s.failed} requests failed") + ")"))
        if ok or len(attempts) == MAX_ATTEMPTS:
            break
        d = round_up(d * RETRY_FACTOR)
    cpu = sum(c.cpu_s for c in v.cpu.values())
    wall = max((c.cpu_s / c.share for c in v.cpu.values() if c.share > 0), default=0.0)
    line = v.cpu.get("delayline")
    return ScalePoint(size=size, devices=devices, instances=instances, requests=s.requests, completed=s.completed,
                      dilation=d, passed=ok, attempts=attempts,
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
              window_s: float = WINDOW_S, seed: int = 1, start_dilation: float = START_DILATION) -> int:
    if not sizes or min(sizes) < 3:
        raise InputError("--sizes: at least 3 devices each (one prefill, one relay, one main decoder)")
    if per_device_rps <= 0 or window_s <= 0 or start_dilation <= 0:
        raise InputError("--per-device-rps, --window and --start-dilation must be > 0")
    base = load_scenario(scenario)
    if not all(base.hosts_with_role(r) for r in SHAPE):
        raise InputError(f"{scenario}: bench scale needs a PDD scenario (prefill, relay-decode and decode hosts)")
    points: list[ScalePoint] = []
    t0 = time.monotonic()
    for i, size in enumerate(sizes, 1):
        sc = scaled_scenario(base, size)
        print(f"\n=== bench scale {i}/{len(sizes)}: {size} devices ({devices_of(sc)[1]} instances) "
              f"[{time.monotonic() - t0:.0f} s]", flush=True)
        points.append(measure(sc, size, out, per_device_rps, window_s, seed, start_dilation))
        write_atomic(out / "scale.json", _json(points, scenario, per_device_rps, window_s))
        md = table(points)
        write_atomic(out / "scale.md", md + "\n")
        plot(points, out / "scale.png", per_device_rps, start_dilation)
    print(f"\nbench scale ({scenario}, pdd, {per_device_rps:g} req/s per device, sessions starting over "
          f"{window_s:g} emulated s, token scale {TOKEN_SCALE}) [{time.monotonic() - t0:.0f} s]")
    print(md)
    print(f"\nsaved: {out / 'scale.md'}, {out / 'scale.json'}, {out / 'scale.png'}")
    return 0 if all(p.passed for p in points) else 1


def _json(points: list[ScalePoint], scenario: Path, rps: float, window_s: float) -> str:
    return json.dumps({"scenario": str(scenario), "policy": "pdd", "per_device_rps": rps, "window_s": window_s,
                       "token_scale": TOKEN_SCALE, "points": [asdict(p) for p in points]}, indent=2)
