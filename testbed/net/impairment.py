"""The WAN's delay, jitter and loss: two implementations of one interface.

``WanImpairment`` is what the network build asks of whatever impairs the line between the
datacenters: ``build`` it on the WAN namespace (after the htb rate classes exist), ``impair``
it at run time (faults), read its ``stats``, ``close`` it at teardown. ``Netem`` uses the
kernel's qdisc where the kernel has it; ``DelayLine`` runs the userspace delay line
(``testbed.net.delayline``) where it does not. ``choose`` picks one (``auto`` probes netem
on a scratch link) and says why.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from protocol.worker_config import KV_PORT
from testbed.errors import BuildError, CapabilityError
from testbed.net import netns, runstate, shaping
from testbed.net.delayline_contract import (
    DelayLineConfig,
    DelayLineControl,
    DelayLineReport,
    DirectionConfig,
    DirectionOverride,
)
from testbed.net.plan import NetworkPlan, Shaping

ImpairmentChoice = Literal["auto", "netem", "delayline"]
# Start a process in a namespace and record it in the run: Network.spawn.
Spawn = Callable[..., subprocess.Popen[bytes]]


class WanImpairment(ABC):
    name: str

    def __init__(self, plan: NetworkPlan, reason: str) -> None:
        self.plan, self.reason = plan, reason

    def build(self) -> None:
        """The WAN namespace's qdiscs (rate, buffer; netem where it impairs), then whatever
        else this backend needs to forward frames."""
        p = self.plan
        with netns.iproute(p.wan_ns) as ipr:
            for (_src, dst), s in p.wan_shaping.items():
                # Frames of src->dst leave the WAN namespace through the port facing dst.
                shaping.add_wan_qdiscs(ipr, p.dcs[dst].wan_port, s, p.wan_frame_mtu, self.name == "netem")
        self._forward()

    @abstractmethod
    def _forward(self) -> None:
        """Join the two WAN ports (a bridge, or the delay line reading both)."""

    @abstractmethod
    def impair(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        """Every WAN direction's fault state at once, in wire units; a direction not in
        ``overrides`` goes back to its configuration."""

    def alive(self) -> bool:
        """Whether frames still cross (a process of ours may have died; a qdisc cannot)."""
        return True

    def stats(self) -> DelayLineReport | None:
        """Frames, drops and lateness per direction, where the backend counts them."""
        return None

    def close(self) -> DelayLineReport | None:
        """Stop (the namespace's deletion removes the qdiscs); the last statistics."""
        return self.stats()


class Netem(WanImpairment):
    name = "netem"

    def _forward(self) -> None:
        p = self.plan
        with netns.iproute(p.wan_ns) as ipr:
            ipr.link("add", ifname="br0", kind="bridge", mtu=p.wan_frame_mtu)
            br = ipr.link_lookup(ifname="br0")[0]
            for dc in p.wan_between:
                ipr.link("set", index=ipr.link_lookup(ifname=p.dcs[dc].wan_port)[0], master=br)
            ipr.link("set", index=br, state="up")

    def impair(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        """netem's qdisc changed in place (down = 100 % loss)."""
        with netns.iproute(self.plan.wan_ns) as ipr:
            for (src, dst), s in self.plan.wan_shaping.items():
                o = overrides.get((src, dst), DirectionOverride())
                shaping.change_netem(ipr, self.plan.dcs[dst].wan_port, s, self.plan.wan_frame_mtu,
                                     loss_pct=100.0 if o.down else o.loss_pct, extra_delay_ms=o.extra_delay_ms)


class DelayLine(WanImpairment):
    name = "delayline"

    def __init__(self, plan: NetworkPlan, reason: str, run_dir: Path, seed: int, spawn: Spawn) -> None:
        super().__init__(plan, reason)
        self.run_dir, self.seed, self.spawn = run_dir, seed, spawn
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def stats_path(self) -> Path:
        return self.run_dir / "delayline-stats.json"

    @property
    def control_path(self) -> Path:
        return self.run_dir / "delayline-control.json"

    def _forward(self) -> None:
        p = self.plan
        ready = self.run_dir / "delayline.ready"
        cfg = DelayLineConfig(
            ports={dc: p.dcs[dc].wan_port for dc in p.wan_between},
            directions=[
                DirectionConfig(src=src, dst=dst, delay_ms=s.delay_ms, jitter_ms=s.jitter_ms, loss_pct=s.loss_pct,
                                max_backlog_bytes=_backlog_cap(s))
                for (src, dst), s in p.wan_shaping.items()
            ],
            stats_path=str(self.stats_path), ready_path=str(ready), seed=self.seed,
            control_path=str(self.control_path), kv_ports=[KV_PORT],
        )  # fmt: skip
        proc = self.proc = self.spawn(p.wan_ns, [sys.executable, "-m", "testbed.net.delayline",
                                                 cfg.model_dump_json()],
                                      name=runstate.DELAY_LINE, log=self.run_dir / "delayline.log")
        wait_for(lambda: ready.exists() or proc.poll() is not None, 10, "delay line start")
        if proc.poll() is not None:
            log = (self.run_dir / "delayline.log").read_text()[-2000:]
            raise BuildError(f"delay line exited with {proc.returncode}: {log}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def impair(self, overrides: dict[tuple[str, str], DirectionOverride]) -> None:
        """A control file, then SIGUSR1: the delay line applies it at once."""
        if not self.alive() or self.proc is None:
            raise BuildError("the delay line is not running")
        control = DelayLineControl(directions={f"{src}->{dst}": o for (src, dst), o in overrides.items()})
        tmp = self.control_path.with_suffix(".tmp")
        tmp.write_text(control.model_dump_json())
        tmp.replace(self.control_path)
        self.proc.send_signal(signal.SIGUSR1)

    def stats(self) -> DelayLineReport | None:
        try:
            return DelayLineReport.model_validate_json(self.stats_path.read_text())
        except (OSError, ValueError):
            return None

    def close(self) -> DelayLineReport | None:
        """SIGTERM: the delay line writes its final statistics as it exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.stats()


def choose(requested: ImpairmentChoice, plan: NetworkPlan, run_dir: Path, seed: int,
           spawn: Spawn) -> WanImpairment:
    """``delayline`` or ``netem`` as asked (netem fails where the kernel lacks it), or
    (``auto``) netem where it works, else the delay line; the reason says which and why."""
    needs = any(s.delay_ms or s.jitter_ms or s.loss_pct for s in plan.wan_shaping.values())
    if requested == "delayline":
        return DelayLine(plan, "requested", run_dir, seed, spawn)
    ok, why = shaping.netem_available(plan.wan_ns)
    if requested == "netem":
        if not ok:
            raise CapabilityError(f"--impairment netem: {why}. Use --impairment delayline (or auto).")
        return Netem(plan, "requested")
    if ok:
        return Netem(plan, why)
    return DelayLine(plan, why + ("" if needs else "; no delay/jitter/loss configured, delay line forwards only"),
                     run_dir, seed, spawn)


def _backlog_cap(s: Shaping) -> int:
    hold_s = (s.delay_ms + s.jitter_ms) / 1000 + 0.05
    rate = s.rate_bps or 40e9  # unshaped: what the kernel could possibly push (40 Gbit/s)
    return int(rate / 8 * hold_s) + s.queue_bytes


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise BuildError(f"timed out waiting for {what}")
        time.sleep(0.005)
