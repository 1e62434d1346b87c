"""The router's estimate of how long new KV would wait to cross the WAN.

``wait_s(delta)`` = ``SETUP_RTTS`` round trips (connect, the receiver's offer, the final
acknowledgement) + (bytes still to cross for transfers in flight + ``delta``) / rate, where
rate = configured WAN rate x an efficiency factor learned from finished transfers: an EWMA
of how the byte-time part of each prediction compared with what was observed (the round
trips taken out), so it tracks TCP's real share of the line and competing traffic without
mistaking round trips for a slow line. Transfers in flight are drained from the backlog at
the estimated rate as time passes, so a stale backlog does not linger. A transfer whose end
is never reported (its KvSent lost with a dead worker or a restarted broker) is forgotten
once it has been in flight ``STALE_FACTOR`` times its predicted time and at least
``STALE_MIN_S``: kept, its old start would drain every newer transfer from the backlog and
the line would read idle for the rest of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import clock

SETUP_RTTS = 3
MIN_SAMPLE_BYTES = 256 * 1024  # smaller transfers say more about round trips than about the rate
STALE_FACTOR = 4.0
# Past the KV connections' own timeout (workers.kv_timeout_s, 120 s by default, times the
# dilation): a transfer still unreported by then ended without a word. Above D 2.5 a live
# transfer slower than this may be forgotten early: the backlog then reads low, never stuck.
STALE_MIN_S = 300.0


@dataclass
class _Transfer:
    nbytes: int
    started: float
    predicted_s: float  # byte-time part only


@dataclass
class WanEstimator:
    rate_bps: float  # configured line rate, bits/s
    rtt_s: float = 0.0
    efficiency: float = 1.0
    alpha: float = 0.3
    inflight: dict[str, _Transfer] = field(default_factory=dict)
    samples: int = 0

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bps / 8 * self.efficiency

    def backlog_bytes(self, now: float | None = None) -> float:
        now = clock.now() if now is None else now
        self._forget_stale(now)
        total = sum(t.nbytes for t in self.inflight.values())
        oldest = min((t.started for t in self.inflight.values()), default=now)
        return max(0.0, total - (now - oldest) * self.bytes_per_s)

    def _byte_time(self, delta_bytes: int, now: float | None) -> float:
        return (self.backlog_bytes(now) + delta_bytes) / self.bytes_per_s

    def wait_s(self, delta_bytes: int, now: float | None = None) -> float:
        if delta_bytes <= 0:
            return 0.0
        return SETUP_RTTS * self.rtt_s + self._byte_time(delta_bytes, now)

    def _forget_stale(self, now: float) -> None:
        stale = [rid for rid, t in self.inflight.items()
                 if now - t.started > max(STALE_MIN_S, STALE_FACTOR * t.predicted_s)]
        for rid in stale:
            del self.inflight[rid]

    def started(self, rid: str, nbytes: int, now: float | None = None) -> None:
        now = clock.now() if now is None else now
        self.inflight[rid] = _Transfer(nbytes, now, self._byte_time(nbytes, now))

    def finished(self, rid: str, observed_s: float | None, cancelled: bool = False) -> None:
        t = self.inflight.pop(rid, None)
        if t is None or cancelled or not observed_s or t.nbytes < MIN_SAMPLE_BYTES:
            return
        observed = max(observed_s - SETUP_RTTS * self.rtt_s, 1e-3)
        ratio = min(4.0, max(0.05, t.predicted_s / observed))
        self.efficiency = min(1.0, max(0.02, self.efficiency * ((1 - self.alpha) + self.alpha * ratio)))
        self.samples += 1
