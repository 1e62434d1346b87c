"""Apply a fault timeline to a running emulation, at the emulated times it gives.

``FaultInjector`` runs on its own thread from the moment the replay's clock starts
(``start``): each fault is applied at ``at_s`` x dilation real seconds later and cleared at
its end. Network faults go through the network backend (``Network.impair_wan``,
``Network.set_wan_rate``), in wire units mapped by the run's emulation like the scenario's
own WAN; several faults active on one direction combine (down wins, the highest loss,
delays add up, the lowest rate). ``kill`` sends SIGKILL to the worker's recorded PID (and, at
its end, the cluster starts it again with empty caches); ``broker-restart``, ``broker-stop``,
``router-kill`` and ``clock-step`` go through the cluster. Every application is logged (stderr) and kept
as an ``AppliedFault`` (saved with the run): planned and actual emulated times, what was
done, and any error (a fault that could not be applied is reported, never silently skipped).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from protocol import clock
from testbed.faults.timeline import NETWORK_KINDS, AppliedFault, Fault
from testbed.net import netns
from testbed.net.delayline_contract import DirectionOverride
from testbed.net.plan import NetworkPlan


@dataclass
class _Wire:
    """Emulated -> wire units of the run (``EmulationPlan``; identity without one)."""

    dilation: float = 1.0
    rate_bps: Callable[[float], float] = field(default=lambda bps: bps)


class WanControl(Protocol):
    """What network faults act on: the emulation's ``Network`` or the simulator's links."""

    @property
    def plan(self) -> NetworkPlan: ...

    def impair_wan(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None: ...

    def set_wan_rate(self, src: str, dst: str, rate_bps: int | None) -> None: ...


class FaultInjector:
    """``start`` runs the timeline on a thread against the host's clock (the emulation);
    ``run_async`` on the running event loop (the simulator, in virtual time). Both apply each
    fault through ``fire``; ``kill_worker`` (host -> what was done) replaces the signal to the
    worker's process (the simulator ends its worker itself)."""

    def __init__(self, net: WanControl, faults: list[Fault], dilation: float = 1.0,
                 wire_rate_bps: Callable[[float], float] | None = None,
                 restart_broker: Callable[[float], str] | None = None,
                 restart_worker: Callable[[str], str] | None = None,
                 kill_worker: Callable[[str], str] | None = None,
                 stop_broker: Callable[[], str] | None = None,
                 kill_router: Callable[[], str] | None = None,
                 step_clock: Callable[[str | None, float], str] | None = None) -> None:
        self.net = net
        self.stop_broker, self.kill_router, self.step_clock = stop_broker, kill_router, step_clock
        self.kill_worker = kill_worker
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.wire = _Wire(dilation, wire_rate_bps or (lambda bps: bps))
        self.restart_broker = restart_broker
        self.restart_worker = restart_worker
        self.log: list[AppliedFault] = [AppliedFault(fault=f.label, kind=f.kind, at_s=f.at_s) for f in self.faults]
        self.active: set[int] = set()  # indexes of network faults in effect
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.t0_stamp = clock.now()  # emulated time 0 on the stamp clock (``clock.now``: the client's records)

    # ------------------------------------------------------------------ lifecycle
    def start(self, t0: float | None = None) -> None:
        """Start the timeline; ``t0`` (time.monotonic) is emulated time 0."""
        if self._thread is not None:
            return
        self._set_t0(t0)
        if not self.faults:
            return
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)
        self._thread.start()

    def stop(self) -> list[AppliedFault]:
        """Stop applying (faults still pending are logged as not applied); the log."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for i, entry in enumerate(self.log):
            if entry.applied_s is None and entry.error is None:
                self.log[i] = entry.model_copy(update={"error": "not applied: the replay ended first"})
        return self.log

    def _set_t0(self, t0: float | None) -> None:
        self._t0 = clock.monotonic() if t0 is None else t0
        self.t0_stamp = clock.now() - (clock.monotonic() - self._t0)

    def emulated_now(self) -> float:
        return (clock.monotonic() - self._t0) / self.wire.dilation

    # ------------------------------------------------------------------ the timeline
    def events(self) -> list[tuple[float, int, int]]:
        """(emulated time, clear?, fault index), in the order they happen."""
        return sorted([(f.at_s, 0, i) for i, f in enumerate(self.faults)]
                      + [(f.end_s, 1, i) for i, f in enumerate(self.faults) if f.end_s is not None])

    def _run(self) -> None:
        for at_s, clear, i in self.events():
            if self._stop.wait(max(0.0, self._t0 + at_s * self.wire.dilation - clock.monotonic())):
                return
            self.fire(i, bool(clear))

    async def run_async(self, t0: float | None = None) -> None:
        """The timeline on the running loop from ``t0`` (its clock, ``protocol.clock``);
        cancel the task to stop it."""
        self._set_t0(t0)
        for at_s, clear, i in self.events():
            await asyncio.sleep(max(0.0, self._t0 + at_s * self.wire.dilation - clock.monotonic()))
            self.fire(i, bool(clear))

    def fire(self, i: int, clear: bool) -> None:
        """Apply (or clear) fault ``i`` now, and record it."""
        if clear and self.log[i].applied_s is None:
            return  # never applied: nothing to clear
        now = self.emulated_now()
        try:
            detail = self._clear(i) if clear else self._apply(i)
        except Exception as e:  # noqa: BLE001 - a fault that fails is reported, the run goes on
            self._record(i, clear, now, error=f"{type(e).__name__}: {e}")
            return
        self._record(i, clear, now, detail=detail)

    def _record(self, i: int, clear: bool, now: float, detail: str = "", error: str | None = None) -> None:
        entry = self.log[i]
        if error is not None:
            update = {"error": error}
        elif clear:
            update = {"cleared_s": now}
        else:
            update = {"applied_s": now, "detail": detail}
        self.log[i] = entry.model_copy(update=update)
        what = "cleared" if clear else "applied"
        print(f"  fault {entry.fault}: {'FAILED ' + error if error else what} at {now:.2f} s emulated"
              + (f" ({detail})" if detail else ""), file=sys.stderr, flush=True)

    def _apply(self, i: int) -> str:
        f = self.faults[i]
        if f.kind in NETWORK_KINDS:
            self.active.add(i)
            return self._push_network(f)
        if f.kind == "kill":
            return self.kill_worker(f.host or "") if self.kill_worker else self._kill(f.host or "")
        if f.kind in ("broker-stop", "router-kill"):
            act = self.stop_broker if f.kind == "broker-stop" else self.kill_router
            if act is None:
                raise RuntimeError(f"{f.kind}: this deployment cannot do it")
            return act()
        if f.kind == "clock-step":
            return self._step(f, f.s or 0.0)
        if f.kind == "broker-restart":
            if self.restart_broker is None:
                raise RuntimeError("no broker in this run")
            return self.restart_broker((f.duration_s or 0.0) * self.wire.dilation)
        raise ValueError(f"unknown fault kind {f.kind}")

    def _clear(self, i: int) -> str:
        f = self.faults[i]
        if f.kind in NETWORK_KINDS:
            self.active.discard(i)
            return self._push_network(f)
        if f.kind == "kill":
            if self.restart_worker is None:
                raise RuntimeError("no cluster to restart the worker in")
            return self.restart_worker(f.host or "")
        if f.kind == "clock-step":
            return self._step(f, -(f.s or 0.0))  # the step taken back
        return ""  # broker-restart's duration is its downtime, inside _apply

    # ------------------------------------------------------------------ kinds
    def _directions(self, f: Fault) -> list[tuple[str, str]]:
        a, b = self.net.plan.wan_between
        if f.dir == "both" or f.kind == "partition":
            return [(a, b), (b, a)]
        src, dst = f.dir.split("->")
        return [(src, dst)]

    def _push_network(self, changed: Fault) -> str:
        """Recompute every direction's state from the faults now active, and apply it."""
        overrides: dict[tuple[str, str], DirectionOverride] = {}
        rates: dict[tuple[str, str], float] = {}
        for key in self.net.plan.wan_shaping:
            down, loss, extra = False, None, 0.0
            for i in self.active:
                f = self.faults[i]
                if key not in self._directions(f):
                    continue
                if f.kind in ("wan-down", "partition"):
                    down = True
                elif f.kind == "loss" and f.pct is not None:
                    loss = max(loss or 0.0, f.pct)
                elif f.kind == "delay" and f.ms is not None:
                    extra += f.ms * self.wire.dilation
                elif f.kind == "rate" and f.mbit is not None:
                    rates[key] = min(rates.get(key, float("inf")), f.mbit * 1e6)
            if down or loss is not None or extra:
                overrides[key] = DirectionOverride(down=down, loss_pct=loss, extra_delay_ms=extra)
        if changed.kind == "rate":
            for key in self._directions(changed):
                emulated = rates.get(key)
                self.net.set_wan_rate(*key, None if emulated is None else int(self.wire.rate_bps(emulated)))
        else:
            self.net.impair_wan(overrides)
        dirs = ", ".join(f"{s}->{d}" for s, d in self._directions(changed))
        if changed.kind == "partition":
            return f"datacenter {changed.dc} cut off ({dirs} down)"
        what = {"wan-down": "down", "loss": f"loss {changed.pct} %", "delay": f"+{changed.ms} ms",
                "rate": f"at {changed.mbit} Mbit/s"}[changed.kind]
        return f"{dirs} {what}"

    def _step(self, f: Fault, s: float) -> str:
        if self.step_clock is None:
            raise RuntimeError("clock-step: this deployment cannot do it")
        return self.step_clock(f.host, s)

    def _kill(self, host: str) -> str:
        name = f"worker-{host}"
        procs = [p for p in self.net.run.processes if p.name == name]  # type: ignore[attr-defined]  # the emulation's
        if not procs:
            raise LookupError(f"no process {name} in this run")
        pid, start = procs[-1].pid, procs[-1].starttime
        if start is None or not netns.signal_exact(pid, start, signal.SIGKILL):  # the PID may be another's now
            return f"{name} (pid {pid}) had already ended: nothing killed"
        return f"SIGKILL to {name} (pid {pid})"


def annotate_failures(errors: dict[str, tuple[float, float, str]], log: list[AppliedFault]) -> dict[str, str]:
    """Failure reasons that name the faults in effect while the request lived.

    ``errors``: rid -> (sent, ended, reason), times in emulated seconds of the fault clock.
    """
    out = {}
    for rid, (sent, ended, reason) in errors.items():
        during = [f.fault for f in log if f.active_between(sent, ended)]
        out[rid] = reason + (f" (during fault {', '.join(during)})" if during else "")
    return out
