"""``testbed bench sim`` (``make bench-sim``): how fast the simulator answers, beside the emulation.

Each measurement is one ``testbed run`` in a process of its own, so its wall time, CPU time
and peak resident memory (the kernel's, for that process alone) are its own:

* the simulator replaying ``--limit`` requests of the trace at token scale 1 (production
  lengths: 64K-token contexts, 1K-token answers in the report's traffic), and at the
  emulation's token scale;
* the emulation replaying ``--emulation-limit`` of them at its token scale, at dilation 1:
  its requests per wall second, the rate the simulator's is compared with;
* the event loop's floor (``loop_floor``): what one decode step costs in asyncio alone, and
  so the most requests per second any replay that executes the workers' code step by step
  can reach at token scale 1, given the steps a request took in the first replay;
* with ``--hour``, an emulated hour of the same recipe (``testbed trace gen`` with the
  trace's own header, ``--hour-requests`` requests over 3,600 s) in the simulator at token
  scale 1.

The table goes to stdout and ``bench-sim.md`` / ``bench-sim.json`` in ``--out``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from testbed.bench.loop_floor import floor_us_per_step
from testbed.engines import kind
from testbed.outputs import write_atomic
from testbed.traces import load_trace
from testbed.traces.generate import GenConfig, generate_file

HOUR_S = 3600.0


@dataclass
class Measured:
    what: str
    engine: str
    token_scale: int
    requests: int
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    exit: int

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


def measure(what: str, argv: list[str], engine: str, token_scale: int, requests: int) -> Measured:
    """One ``testbed`` command in a child process: wall time, CPU time, peak RSS."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "testbed", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    if proc.returncode not in (0, 1):
        print(err[-3000:], file=sys.stderr)
    m = Measured(what, engine, token_scale, requests, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                 proc.returncode)
    print(f"  {what}: {requests} requests in {wall:.1f} s ({m.rps:.1f} requests/s), CPU {m.cpu_s:.1f} s, "
          f"peak RSS {m.max_rss_mb:.0f} MB", flush=True)
    return m


def hour_trace(trace: Path, out: Path, requests: int) -> Path:
    """The trace's recipe (its header) over an emulated hour, ``requests`` requests."""
    header = json.loads(trace.read_text().splitlines()[0])
    fields = set(GenConfig.__dataclass_fields__)
    cfg = GenConfig(**{k: v for k, v in header.items() if k in fields})
    cfg.duration_s, cfg.rps = HOUR_S, requests / HOUR_S
    path = out / "hour.jsonl"
    generate_file(cfg, path)
    return path


def run_bench(scenario: Path, trace: Path, limit: int, emulation_limit: int, scale: int, policy: str,
              hour_requests: int | None, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    common = ["--scenario", str(scenario), "--policies", policy]
    rows: list[Measured] = []
    print(f"bench sim: {trace} on {scenario}, policy {policy}", flush=True)
    rows.append(measure("simulator, token scale 1",
                        ["run", "--engine", "sim", *common, "--trace", str(trace), "--token-scale", "1",
                         "--limit", str(limit), "--out", str(out / "sim-1")], "sim", 1, limit))
    rows.append(measure(f"simulator, token scale {scale}",
                        ["run", "--engine", "sim", *common, "--trace", str(trace), "--token-scale", str(scale),
                         "--limit", str(limit), "--out", str(out / f"sim-{scale}")], "sim", scale, limit))
    floor = loop_floor_line(out / "sim-1", limit)
    print(f"  {floor}", flush=True)
    if emulation_limit > 0:
        rows.append(measure(f"emulation, token scale {scale}, D 1",
                            ["run", *common, "--trace", str(trace), "--token-scale", str(scale), "--dilation", "1",
                             "--limit", str(emulation_limit), "--allow-infidelity", "--out", str(out / "emulation")],
                            "emulation", scale, emulation_limit))
    if hour_requests:
        hour = hour_trace(trace, out, hour_requests)
        rows.append(measure("simulator, an emulated hour, token scale 1",
                            ["run", "--engine", "sim", *common, "--trace", str(hour), "--token-scale", "1",
                             "--out", str(out / "sim-hour")], "sim", 1, len(load_trace(hour).requests)))
    text = format_bench(rows) + "\n\n" + floor
    write_atomic(out / "bench-sim.md", text + "\n")
    write_atomic(out / "bench-sim.json", json.dumps([asdict(r) | {"rps": r.rps} for r in rows], indent=2))
    print("\n" + text + f"\nsaved: {out / 'bench-sim.md'}", flush=True)
    return 0 if all(r.exit in (0, 1) for r in rows) else 1


def loop_floor_line(folder: Path, requests: int) -> str:
    """The loop's floor a step, beside the steps a request took in the replay saved in ``folder``."""
    summary = json.loads((folder / "summary.json").read_text())
    workers = next(iter(summary["policies"].values()))["fidelity"]["workers"]
    per_request = sum(w["steps"] for w in workers.values()) / max(1, requests)
    us = floor_us_per_step()
    return (f"the event loop's floor: {us:.1f} us a step in asyncio alone; at token scale 1 a request took "
            f"{per_request:.0f} steps, so no replay that executes the workers' code step by step exceeds "
            f"{1e6 / (us * per_request):.0f} requests/s here")


def format_bench(rows: list[Measured]) -> str:
    emu = next((r for r in rows if not kind(r.engine).virtual_time), None)
    lines = ["| replay | requests | wall s | requests/s | x the emulation | CPU s | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r.rps / emu.rps:.0f}x" if emu and emu.rps and r is not emu else "-"
        lines.append(f"| {r.what} | {r.requests} | {r.wall_s:.1f} | {r.rps:.1f} | {ratio} | {r.cpu_s:.1f} | "
                     f"{r.max_rss_mb:.0f} |")
    lines.append("")
    lines.append(f"(one core per replay: each is one process; {os.cpu_count()} cores here; "
                 f"this process's own peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    return "\n".join(lines)
