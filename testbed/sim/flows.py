"""TCP flows on the link model: max-min fair sharing, slow start, stalls and timeouts.

A KV transfer's bytes are a flow over a path (``links.Path``). ``Flows`` keeps every flow in
progress and moves them on between events (a flow starts or ends, a window doubles, a stall
ends, a fault changes a link), at rates recomputed at each one:

* **sharing**: weighted progressive filling: every link's capacity is shared among the
  flows that cross it in proportion to weights drawn per flow (``links.SHARE_WEIGHTS``:
  competing TCP flows through a small buffer are not fair over a transfer's lifetime, as
  measured), each flow also capped by what it could carry alone (``cap``);
* **the window**: a flow carries at most its connection's congestion window per round
  trip; while that window is what holds it back, it doubles every round trip (slow start,
  BBR's startup alike); once the flow is held back by the network it stops growing, and
  grows again if its share rises beyond it. It never outgrows what TCP lets it reach: the
  receiver's window and the path's bandwidth-delay product with its buffers
  (``Path.max_cwnd``), past which a window limits no rate; however long a flow waited, its
  window is a float within that bound (unbounded, BBR's probes below made one double
  every round trip of each probe until it overflowed a float in an hour's replay). That
  a probe's four segments count as a window to grow, so that a connection leaves its first
  probe at the bound, is how the model was validated; without it cross-dc's TTFT P50 on
  1,000 requests of ``traces/paper.jsonl`` is 20 % lower (docs/simulation.md);
* **the congestion control** (``CONGESTION``: the emulation host's default, read from the
  kernel, since the emulation's TCP is the kernel's): with ``cubic`` (or reno) a connection
  idle past its retransmission timeout starts its window over (Linux's restart after idle),
  a lossy path caps a flow at ``1.22 MSS / (RTT sqrt(p))`` (Mathis et al.) and an outage
  leaves a window of one segment to grow again; with ``bbr`` a connection resumes from idle
  at the rate it had measured, loss costs only what is resent (a share ``p`` of the rate),
  and after an outage it restores its window; a BBR connection busy for 10 s without a
  moment of empty queue probes its minimum RTT (200 ms + a round trip at 4 segments);
* **stalls**: a flow whose path is down moves nothing; after an outage it waits for its
  connection's next retransmission (``LinkModel.impair``); a flow that moved nothing for
  its ``timeout_s`` fails with ``TimeoutError`` (the peer took nothing).

Every tie is broken by the order flows started in (``Flow.seq``): runs repeat exactly.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from testbed.sim.links import (
    BBR_MIN_RTT_S,
    BBR_PROBE_RTT_S,
    BBR_PROBE_SEGMENTS,
    INITIAL_WINDOW,
    MATHIS_C,
    QUEUE_FILL,
    RTO_MAX_S,
    RTO_MIN_S,
    SHARE_CONVERGE_S,
    SHARE_REWEIGH_S,
    SHARE_STEADY_S,
    SHARE_WEIGHTS,
    UNFAIR_FLOWS,
    Conn,
    Flow,
    Link,
    Origin,
    Versioned,
    spread,
)

CONGESTION_PATH = Path("/proc/sys/net/ipv4/tcp_congestion_control")


def host_congestion() -> str:
    """The congestion control this host's TCP uses by default (what the emulation's
    connections run): ``bbr``, or ``cubic`` for anything loss-based."""
    try:
        return "bbr" if CONGESTION_PATH.read_text().strip() == "bbr" else "cubic"
    except OSError:
        return "cubic"


class _Model(Versioned, Protocol):
    loop: asyncio.AbstractEventLoop

EPS_BYTES = 1e-6
# A flow within this many seconds of its end has ended, and no event of the model is set
# closer than this to now: the loop counts a timer within its resolution (1 ns) as due, so a
# flow a fraction of a byte short of its end was rescheduled at "now" millions of times
# while the clock crept on by rounding (a replay at a tenth of the load never finished).
TIME_EPS_S = 1e-6
SPREAD_GONE = 1e-3  # a spread decayed to this share of its draw is none: the rates stop being re-weighed


class Flows:
    def __init__(self, model: _Model, congestion: str = "cubic", rng: random.Random | None = None) -> None:
        self.model = model
        self.congestion = congestion
        self.rng = rng or random.Random(0)
        self.loop = model.loop
        self.active: dict[Flow, None] = {}  # ordered: runs repeat exactly
        self._seq = 0
        self._last = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- a transfer
    def prepare(self, conn: Conn) -> float:
        """Before a transfer on ``conn``: the handshake a new connection pays (seconds), and
        the window a connection idle past its retransmission timeout restarts from."""
        now = self.loop.time()
        if not conn.established:
            conn.established = True
            return conn.path.rtt_s
        if self.congestion != "bbr" and now - conn.last_active > conn.rto_s:
            halvings = (now - conn.last_active) / conn.rto_s  # Linux halves it per idle timeout
            conn.cwnd = max(INITIAL_WINDOW, conn.cwnd / 2 ** min(halvings, 64))
        return 0.0

    async def send(self, conn: Conn, nbytes: float, cancel: Sequence[asyncio.Event] = (),
                   timeout_s: float | None = None, origin: Origin | None = None) -> float:
        """Push ``nbytes`` through ``conn``'s path; returns when the last byte has left the
        path's bottleneck (or one of ``cancel`` is set: then with what had left by then).
        Returns the bytes sent. Raises TimeoutError when the flow moved nothing for
        ``timeout_s`` (the peer took nothing: its path is down). ``origin``: a burst of a
        streamed transfer, which shares its first burst's start and draw."""
        if nbytes <= 0:
            return 0.0
        if not conn.path.links:  # the same host: no link to cross
            return float(nbytes)
        self.advance()
        self._seq += 1
        if origin is None or origin.born is None:
            draw, born = self.rng.uniform(*SHARE_WEIGHTS), self.loop.time()
            if origin is not None:
                origin.born, origin.draw = born, draw
        else:
            draw, born = origin.draw, origin.born
        flow = Flow(conn, float(nbytes), self._seq, self.loop.create_future(), timeout_s, draw=draw, born=born)
        if self.congestion == "bbr" and not any(lk.flows for lk in conn.path.links if lk.capacity):
            conn.probe_due = self.loop.time() + BBR_MIN_RTT_S  # an empty queue: the minimum RTT is seen
        self.active[flow] = None
        for lk in conn.path.links:
            lk.flows[flow] = None
        self.reschedule()
        try:
            if not cancel:
                await flow.done
            elif not any(ev.is_set() for ev in cancel):
                stops = [asyncio.ensure_future(ev.wait()) for ev in cancel]
                try:
                    await asyncio.wait({flow.done, *stops}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for stop in stops:
                        stop.cancel()
                if flow.done.done():
                    flow.done.result()  # a timeout raises
        finally:
            self._remove(flow)
        return flow.sent

    def through(self, lk: Link) -> list[Flow]:
        return [f for f in self.active if lk in f.conn.path.links or lk in f.conn.path.back]

    def _remove(self, flow: Flow) -> None:
        if flow not in self.active:
            return
        self.advance()
        del self.active[flow]
        for lk in flow.conn.path.links:
            lk.flows.pop(flow, None)
        flow.conn.last_active = self.loop.time()
        self.reschedule()

    # ----------------------------------------------------------------- the fluid model
    def advance(self) -> None:
        """Move every flow on to now at its current rate."""
        now = self.loop.time()
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        for f in self.active:
            if f.rate > 0:
                moved = min(f.remaining, f.rate * dt)
                f.sent += moved
                for lk in f.conn.path.links:
                    lk.busy_bytes += moved
                    if f.conn.kv and lk.kv_bins is not None:
                        spread(lk.kv_bins, now - dt, now - dt + moved / f.rate, moved)

    def _cap(self, f: Flow, now: float) -> float:
        """What a flow could carry alone: its window over the round trip, the loss limit."""
        p = f.conn.path
        if f.stalled_until > now or p.down():
            return 0.0
        rtt = max(p.rtt_s, 1e-6)
        if now < f.conn.probing_until:
            f.window = BBR_PROBE_SEGMENTS * p.mss / rtt
            return f.window
        f.window = f.conn.cwnd * p.mss / rtt
        cap = f.window
        loss = p.loss
        if loss > 0:
            if self.congestion == "bbr":
                bottleneck = p.bottleneck
                cap = min(cap, (1 - loss) * bottleneck) if bottleneck is not None else cap
            else:
                cap = min(cap, MATHIS_C * p.mss / (rtt * math.sqrt(loss)))
        return cap

    def resumed(self, f: Flow, down_since: float, now: float) -> None:
        """``f``'s path is back after an outage: it waits for its next retransmission; a
        loss-based window starts over from one segment, BBR restores its own."""
        p = f.conn.path
        queued = sum(QUEUE_FILL[self.congestion] * lk.queue_bytes / lk.capacity for lk in p.links
                     if lk.capacity and lk.queue_bytes)  # the flow was filling its line
        f.stalled_until = max(f.stalled_until, resume_at(f.conn, down_since, now, p.rtt_s + queued))
        if self.congestion != "bbr":
            f.conn.ssthresh = max(2.0, f.conn.cwnd / 2)
            f.conn.cwnd = 1.0

    def _allocate(self, now: float) -> None:
        """Weighted max-min rates: progressive filling of a level per unit of weight, over
        links and each flow's own cap."""
        room: dict[Link, float] = {}
        weight: dict[Link, float] = {}
        crossing: dict[Link, int] = {}
        unfixed: list[Flow] = []
        for f in self.active:
            f.rate = 0.0
            f.cap = self._cap(f, now)
            if f.cap > 0:
                unfixed.append(f)
                for lk in f.conn.path.links:
                    crossing[lk] = crossing.get(lk, 0) + 1
        for f in unfixed:
            n = max((crossing[lk] for lk in f.conn.path.links if lk.capacity is not None), default=1)
            f.spread = min(1.0, (n - 1) / UNFAIR_FLOWS) * (f.draw - 1)
            f.weight = 1 + f.spread * spread_left(now - f.born)
            for lk in f.conn.path.links:
                if lk.capacity is not None:
                    room.setdefault(lk, lk.capacity)
                    weight[lk] = weight.get(lk, 0.0) + f.weight
        by_cap = sorted(unfixed, key=lambda f: (f.cap / f.weight, f.seq))
        left = set(unfixed)
        i = 0
        while left:
            while by_cap[i] not in left:
                i += 1
            own = by_cap[i]
            level, limiter = math.inf, None
            for lk, w in weight.items():
                if w > 1e-12 and room[lk] / w < level:
                    level, limiter = room[lk] / w, lk
            if own.cap / own.weight <= level:
                fixed, rate_of = [own], {own: own.cap}
            else:
                assert limiter is not None
                fixed = [f for f in limiter.flows if f in left]
                rate_of = {f: f.weight * level for f in fixed}
            for f in fixed:
                f.rate = rate_of[f]
                left.discard(f)
                for lk in f.conn.path.links:
                    if lk in room:
                        room[lk] = max(0.0, room[lk] - f.rate)
                        weight[lk] -= f.weight

    def reschedule(self) -> None:
        """Settle what is due now (ends, windows), recompute the rates, set the next event."""
        try:
            self._reschedule()
        except Exception as e:  # noqa: BLE001 - see _failed
            self._failed(e)

    def _reschedule(self) -> None:
        now = self.loop.time()
        for f in self.active:
            if f.remaining <= max(EPS_BYTES, 1e-9 * f.size, f.rate * TIME_EPS_S) and not f.done.done():
                f.sent = f.size
                f.done.set_result(None)
            rtt = max(f.conn.path.rtt_s, 1e-6)
            if f.next_ramp <= now:  # one doubling per round trip since it became window-limited
                rounds = math.floor((now - f.next_ramp) / rtt) + 1
                f.conn.cwnd = min(f.conn.path.max_cwnd, f.conn.cwnd * 2.0 ** min(rounds, 64))
                f.next_ramp += rounds * rtt
            c = f.conn
            if self.congestion == "bbr" and now >= c.probe_due:
                c.probing_until = now + BBR_PROBE_RTT_S + rtt
                c.probe_due = c.probing_until + BBR_MIN_RTT_S
        self._allocate(now)
        nxt = math.inf
        for f in self.active:
            if f.done.done():
                continue
            rtt = max(f.conn.path.rtt_s, 1e-6)
            if f.rate > 0 and f.rate >= f.window * (1 - 1e-9) and f.conn.cwnd < f.conn.path.max_cwnd:
                # its window holds it back (or BBR's probe does), and may grow
                if f.next_ramp == math.inf:
                    f.next_ramp = now + rtt
                nxt = min(nxt, f.next_ramp)
            else:
                f.next_ramp = math.inf
            if f.rate > 0:
                nxt = min(nxt, now + f.remaining / f.rate)
                if f.spread:  # its weight against the others changes with its age
                    age = now - f.born
                    if age < SHARE_STEADY_S:
                        nxt = min(nxt, f.born + SHARE_STEADY_S)
                    elif spread_left(age) > SPREAD_GONE:
                        nxt = min(nxt, now + SHARE_REWEIGH_S)
            if f.stalled_until > now:
                nxt = min(nxt, f.stalled_until)
            if self.congestion == "bbr":
                nxt = min(nxt, f.conn.probing_until if f.conn.probing_until > now else f.conn.probe_due)
            if f.timeout_s is not None:
                if f.rate > 0:
                    f.idle_since = None
                else:
                    f.idle_since = now if f.idle_since is None else f.idle_since
                    if now - f.idle_since >= f.timeout_s:
                        f.done.set_exception(TimeoutError(f"the peer took nothing for {f.timeout_s:g} s"))
                        continue
                    nxt = min(nxt, f.idle_since + f.timeout_s)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if nxt < math.inf:
            self._timer = self.loop.call_at(max(nxt, now + TIME_EPS_S), self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            self.advance()
        except Exception as e:  # noqa: BLE001 - see _failed
            self._failed(e)
        self.reschedule()

    def _failed(self, e: Exception) -> None:
        """A bug of the model: every transfer in progress fails with it named (their requests
        fail with a reason, their senders go on, later transfers run), and the loop's
        exception handler reports it with the run (``SimDeployment``: the run exits 1)."""
        for f in self.active:
            if not f.done.done():
                f.done.set_exception(RuntimeError(f"the link model failed: {type(e).__name__}: {e}"))
            for lk in f.conn.path.links:
                lk.flows.pop(f, None)
        self.active.clear()
        self.loop.call_exception_handler({"message": "the link model failed", "exception": e})


def spread_left(age_s: float) -> float:
    """How much of its drawn weight spread a flow of this age keeps: all of it for
    ``SHARE_STEADY_S``, then less by e every ``SHARE_CONVERGE_S`` (flows converge to equal
    shares over minutes)."""
    if age_s <= SHARE_STEADY_S:
        return 1.0
    left = math.exp(-(age_s - SHARE_STEADY_S) / SHARE_CONVERGE_S)
    return 0.0 if left <= SPREAD_GONE else left


def resume_at(conn: Conn, down_since: float, up_at: float, srtt: float | None = None) -> float:
    """The first retransmission at or after ``up_at`` of a connection that stalled at
    ``down_since``: its timeout doubles after each one that was lost. The first timeout is
    200 ms plus twice the smoothed round trip ``srtt`` (a loaded line's, queue included),
    fitted to Linux on the emulation's line (``testbed bench links``: outages of 1-19 s
    resumed 3.0, 4.95, 8.9, 21.75, 41.9 s after a loss at 1 s); an idle connection's is
    ``conn.rto_s``."""
    rto = min(RTO_MAX_S, RTO_MIN_S + 2 * srtt) if srtt is not None else conn.rto_s
    t = down_since
    while t + rto < up_at:
        t += rto
        rto = min(RTO_MAX_S, 2 * rto)
    return t + rto
