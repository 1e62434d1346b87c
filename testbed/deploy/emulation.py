"""Emulated time: one rule maps every duration, rate and size (``docs/emulated-time.md``).

``EmulationPlan`` is built once per run from the scenario's ``emulation`` (the emulated
model card), the token scale ``s`` of the replay (``s_in = s_out = s``) and the time
dilation ``D`` (given, or chosen by ``calibrate_dilation``):

* compute: workers price their steps as the emulated model on the emulated device and
  pace to ``D`` x that (``workers/device.py``; this module hands them ``ModelCost`` and
  ``Scales``);
* network: a rate given in emulated units becomes the wire rate
  ``r_wire = r_e x b_r / (s_in x b_e) / D`` (``b_r``: KV bytes per replayed token of the
  real model, ``b_e``: per emulated token of the emulated model), so ``n`` replayed tokens
  of KV (``n x b_r`` bytes) cross in ``D x n x s_in x b_e / r_e``: ``D`` times the emulated
  transfer time. Delays and jitter are multiplied by ``D``, buffers by the byte factor;
  the WAN MTU is chosen so a round trip holds at least ``MIN_FRAMES_IN_FLIGHT`` frames;
* workload: arrival gaps, think times and timeouts are multiplied by ``D``;
* reporting: every measured duration is divided by ``D``; TPOT and ITL are per emulated
  token (also divided by ``s_out``); eager tokens and handoff sizes count emulated tokens.

Without an ``emulation`` in the scenario the plan is the identity (rates and times as
given, ``D`` = 1, reported per replayed token), as before emulation existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from protocol.worker_config import ModelCost, Scales
from testbed.net.plan import FRAME_OVERHEAD
from testbed.scenario import ModelCard, Scenario, WanDirection


class _Saved(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LinkScale(_Saved):
    """A link's rate (and delay) as emulated and as built on the wire."""

    rate_mbit: float | None
    wire_rate_mbit: float | None
    delay_ms: float | None = None
    wire_delay_ms: float | None = None


class EmulationSummary(_Saved):
    emulating: bool
    model: str | None
    s_in: int
    s_out: int
    dilation: float
    dilation_reason: str
    b_r: int  # KV bytes per replayed token of the real model
    b_e: int  # KV bytes per emulated token of the emulated model
    formula: str
    wan_mtu: int
    wan_forward: LinkScale
    wan_reverse: LinkScale
    lan: dict[str, LinkScale]  # per datacenter


MIN_FRAMES_IN_FLIGHT = 64
MIN_MTU = 1280


@dataclass(frozen=True)
class EmulationPlan:
    card_name: str | None
    card: ModelCard | None
    scales: Scales
    b_r: int  # KV bytes per replayed token of the real model, as the workers run it
    dilation_reason: str = "given"
    auto_key: str | None = None  # chosen by ``auto``: its key in the dilation cache (``dilation_cache.py``)
    kv_card: ModelCard | None = None  # whose KV and state cross the line (``Emulation.kv_of``); None: ``card``

    @classmethod
    def make(cls, sc: Scenario, token_scale: int, dilation: float, b_r: int, reason: str = "given",
             auto_key: str | None = None) -> EmulationPlan:
        em = sc.emulation
        if em is None:
            return cls(None, None, Scales(), b_r, "no emulation in the scenario: host time")
        card = sc.models[em.model]
        return cls(em.model, card, Scales(s_in=token_scale, s_out=token_scale, dilation=dilation), b_r, reason,
                   auto_key, sc.models[em.kv_of] if em.kv_of else None)

    @property
    def emulating(self) -> bool:
        return self.card is not None

    @property
    def dilation(self) -> float:
        return self.scales.dilation

    @property
    def wire_card(self) -> ModelCard | None:
        """The card whose KV and state cross the line: ``kv_of``'s, or the model's own."""
        return self.kv_card or self.card

    @property
    def b_e(self) -> int:
        return self.wire_card.kv_bytes_per_token if self.wire_card else self.b_r

    @property
    def byte_factor(self) -> float:
        """Wire bytes per emulated byte of KV: ``b_r / (s_in x b_e)``."""
        return self.b_r / (self.scales.s_in * self.b_e) if self.card else 1.0

    @property
    def state_wire_bytes(self) -> int:
        """Wire bytes of a request's fixed-size state (a hybrid card's): its emulated bytes
        times ``byte_factor``, so that it takes the emulated time on the scaled line."""
        return round(self.wire_card.state_bytes * self.byte_factor) if self.wire_card else 0

    def wire_rate_bps(self, rate_bps: float) -> float:
        return rate_bps * self.byte_factor / self.dilation

    def real_s(self, emulated_s: float) -> float:
        return emulated_s * self.dilation

    def emulated_s(self, real_s: float) -> float:
        return real_s / self.dilation

    def cost(self) -> ModelCost | None:
        """What a forward pass of the emulated model costs (None: price the real model): the
        model's own, with ``kv_of`` too (only the line carries the other card's KV)."""
        return None if self.card is None else self.card.cost()

    # ----------------------------------------------------------------- the wire scenario
    def wire_scenario(self, sc: Scenario) -> Scenario:
        """``sc`` with every rate, delay, jitter and buffer in wire units (what the network
        backend builds); the WAN MTU chosen for >= MIN_FRAMES_IN_FLIGHT frames per RTT."""
        if not self.emulating:
            return sc
        data = sc.model_dump(mode="python")

        def rate(mbit: float | None) -> float | None:
            return None if mbit is None else self.wire_rate_bps(mbit * 1e6) / 1e6

        for direction in ("forward", "reverse"):
            d = data["wan"][direction]
            d["rate_mbit"] = rate(d["rate_mbit"])
            d["delay_ms"] *= self.dilation
            d["jitter_ms"] *= self.dilation
            if d["queue_bytes"]:
                d["queue_bytes"] = max(1, int(d["queue_bytes"] * self.byte_factor))
            # A link trace is in emulated units and reaches the wire as faults (the injector maps
            # them); the wire's own line starts from the scenario's values.
            d["trace"] = None
        for dc in data["datacenters"].values():
            dc["lan"]["rate_mbit"] = rate(dc["lan"]["rate_mbit"])
        data["network"]["wan_mtu"] = sc.network.wan_mtu or self.wan_mtu(sc)
        return Scenario.model_validate({**data, "source": sc.source})

    def wan_mtu(self, sc: Scenario) -> int:
        """The largest MTU (<= the scenario's) that keeps MIN_FRAMES_IN_FLIGHT frames in a
        round trip of the slower WAN direction (a bandwidth-delay product of a few frames
        makes TCP behave nothing like it does over a long fat pipe)."""
        rates = [d.rate_mbit for d in (sc.wan.forward, sc.wan.reverse) if d.rate_mbit]
        if not rates:
            return sc.network.mtu
        rtt_s = (sc.wan.forward.delay_ms + sc.wan.reverse.delay_ms) / 1000 * self.dilation
        bdp = self.wire_rate_bps(min(rates) * 1e6) / 8 * rtt_s
        return max(MIN_MTU, min(sc.network.mtu, int(bdp / MIN_FRAMES_IN_FLIGHT) - FRAME_OVERHEAD))

    # ----------------------------------------------------------------- what is printed and saved
    def summary(self, sc: Scenario) -> EmulationSummary:
        wire = self.wire_scenario(sc)
        s = self.scales

        def wan(emu: WanDirection, w: WanDirection) -> LinkScale:
            return LinkScale(rate_mbit=emu.rate_mbit, wire_rate_mbit=w.rate_mbit, delay_ms=emu.delay_ms,
                             wire_delay_ms=w.delay_ms)

        return EmulationSummary(
            emulating=self.emulating, model=self.card_name, s_in=s.s_in, s_out=s.s_out, dilation=s.dilation,
            dilation_reason=self.dilation_reason, b_r=self.b_r, b_e=self.b_e,
            formula="r_wire = r_e * b_r / (s_in * b_e) / D; d_wire = D * d_e",
            wan_mtu=wire.network.wan_mtu or wire.network.mtu,
            wan_forward=wan(sc.wan.forward, wire.wan.forward), wan_reverse=wan(sc.wan.reverse, wire.wan.reverse),
            lan={dc: LinkScale(rate_mbit=d.lan.rate_mbit, wire_rate_mbit=wire.datacenters[dc].lan.rate_mbit)
                 for dc, d in sc.datacenters.items()},
        )  # fmt: skip

    def describe(self, sc: Scenario) -> str:
        if not self.emulating:
            return f"emulation: none ({self.dilation_reason}); rates and times as given"
        s = self.summary(sc)

        def mbit(v: float | None) -> str:
            return "unshaped" if v is None else (f"{v / 1000:g} Gbit/s" if v >= 1000 else f"{v:.3g} Mbit/s")

        f = s.wan_forward
        kv_of = f" with the KV of {sc.emulation.kv_of}" if sc.emulation and sc.emulation.kv_of else ""
        lines = [
            f"emulation: model {self.card_name}{kv_of} (KV {self.b_e} B/token) on the small model "
            f"(KV {self.b_r} B/token); "
            f"s_in = s_out = {self.scales.s_in}, dilation D = {self.dilation:g} ({self.dilation_reason})",
            f"  {s.formula}: WAN {mbit(f.rate_mbit)} -> wire {mbit(f.wire_rate_mbit)}, "
            f"delay {f.delay_ms:g} -> {f.wire_delay_ms:g} ms, WAN MTU {s.wan_mtu}",
        ]
        for dc, lan in s.lan.items():
            lines.append(f"  LAN {dc}: {mbit(lan.rate_mbit)} -> wire {mbit(lan.wire_rate_mbit)}")
        if self.wire_card is not None and self.wire_card.state_bytes:
            lines.append(f"  a request's fixed-size state (linear layers, window KV): "
                         f"{self.wire_card.state_bytes / 1e6:.1f} MB "
                         f"-> {self.state_wire_bytes:,} wire bytes after each transfer's KV")
        return "\n".join(lines)


def round_up(x: float) -> float:
    """Round a dilation up to two significant digits (1.23 -> 1.3, 12.1 -> 13)."""
    if x <= 0:
        return 1.0
    digits = 1 - math.floor(math.log10(x))
    mag = 10.0**-digits
    return round(math.ceil(x / mag - 1e-9) * mag, max(0, digits))
