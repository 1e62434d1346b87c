"""The simulator's link model against closed forms (no network, no root): one flow, fair
sharing, a rate change, an outage and its retransmission backoff, loss, a stalled flow's
timeout; and its broker: persistent sessions, wills, retained messages, a restart."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiomqtt
import pytest

from protocol.mqtt_session import Session
from testbed.net.plan import FRAME_OVERHEAD, make_plan
from testbed.sim.bus import SimBroker
from testbed.sim.links import INITIAL_WINDOW, QUEUE_FILL, RTO_MIN_S, TCP_IP_HEADERS, Conn
from testbed.sim.network import LinkModel
from testbed.sim.vloop import Stalled, VirtualLoop

from .conftest import small_wan

T = TypeVar("T")
RATE_MBIT, DELAY_MS = 1000.0, 15.0


def _model(loss_pct: float = 0.0, congestion: str = "cubic") -> tuple[VirtualLoop, LinkModel]:
    sc = small_wan(DELAY_MS, RATE_MBIT, loss_fwd=loss_pct)
    loop = VirtualLoop()
    return loop, LinkModel(loop, sc, make_plan(sc, "t"), congestion=congestion)


def _run(loop: VirtualLoop, main: Callable[[], Awaitable[T]]) -> T:
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def _goodput(links: LinkModel) -> float:
    mtu = links.plan.wan_frame_mtu
    return RATE_MBIT * 1e6 / 8 * (mtu - TCP_IP_HEADERS) / (mtu + FRAME_OVERHEAD)


async def _transfer(links: LinkModel, nbytes: float, at: float = 0.0, conn: Conn | None = None) -> float:
    """One transfer from ha (datacenter a) to hc (b) starting at ``at``: when it ended."""
    await asyncio.sleep(at)
    conn = conn or Conn(links.path("ha", "hc"))
    await asyncio.sleep(links.prepare(conn))
    await links.send(conn, nbytes)
    return links.loop.time()


def test_one_flow_pays_a_handshake_and_slow_start_then_runs_at_the_line_rate() -> None:
    loop, links = _model()
    rtt = 2 * DELAY_MS / 1000
    cap = _goodput(links)
    size = 200 * cap * rtt  # 200 bandwidth-delay products
    done = _run(loop, lambda: _transfer(links, size))
    mss = links.plan.wan_frame_mtu - TCP_IP_HEADERS
    ramp_rtts = math.ceil(math.log2(cap * rtt / (INITIAL_WINDOW * mss)))  # doublings until the window fills it
    assert size / cap + rtt < done <= size / cap + rtt * (1 + ramp_rtts)


def test_two_flows_share_the_line_and_the_survivor_takes_it_all() -> None:
    loop, links = _model()
    cap = _goodput(links)
    small, large = 20 * cap, 40 * cap  # 20 and 40 seconds alone

    async def main() -> tuple[float, float]:
        a, b = await asyncio.gather(_transfer(links, small), _transfer(links, large))
        return a, b

    a, b = _run(loop, main)
    # The line never idles: the last byte leaves when the line has carried both (60 s); the
    # other ends once it had its (weighted) share, after it would have alone.
    assert max(a, b) == pytest.approx(60, rel=0.01) and a > 20 and b > 40


def test_many_equal_flows_end_spread_out_as_tcp_through_a_small_buffer_does() -> None:
    """40 equal transfers at once: the line carries them all by the same time, but not
    together; on average they end at ~0.8 of the last (0.83 measured on the emulated line)."""
    loop, links = _model()
    cap = _goodput(links)

    async def main() -> list[float]:
        return list(await asyncio.gather(*(_transfer(links, cap / 4) for _ in range(40))))

    ends = sorted(_run(loop, main))
    assert ends[-1] == pytest.approx(10, rel=0.02)
    assert 0.75 < sum(ends) / len(ends) / ends[-1] < 0.9 and ends[0] < 0.7 * ends[-1]


def test_flows_held_for_minutes_converge_to_equal_shares_and_end_together() -> None:
    """Ten equal transfers keeping the line full for ten minutes end together at its end, as
    the kernel's flows did on the emulated line (``bench links --held 600``: mean completion
    617.4 s of 600 s of goodput); weights kept for life ended them at 0.82 of it."""
    loop, links = _model()
    cap = _goodput(links)

    async def main() -> list[float]:
        return list(await asyncio.gather(*(_transfer(links, 60 * cap) for _ in range(10))))

    ends = sorted(_run(loop, main))
    assert ends[-1] == pytest.approx(600, rel=0.01)
    assert ends[0] > 0.95 * ends[-1] and sum(ends) / len(ends) > 0.97 * ends[-1], ends


def test_a_rate_change_mid_transfer_reshapes_the_flow() -> None:
    loop, links = _model()
    cap = _goodput(links)
    size = 60 * cap

    async def main() -> float:
        loop.call_later(10.0, links.set_rate, ("a", "b"), RATE_MBIT * 1e6 / 2)
        return await _transfer(links, size)

    done = _run(loop, main)
    assert done == pytest.approx(10 + (size - 10 * cap) / (cap / 2), rel=0.02)  # 10 + 100 s


def test_an_outage_stalls_a_flow_until_its_retransmission_after_the_line_is_back() -> None:
    loop, links = _model()
    cap = _goodput(links)
    size = 30 * cap

    async def main() -> float:
        loop.call_later(10.0, links.impair, ("a", "b"), True)
        loop.call_later(25.0, links.impair, ("a", "b"), False)
        return await _transfer(links, size)

    done = _run(loop, main)
    # Retransmissions at 10 + RTO x (1, 3, 7, 15, ...), the timeout doubling after each, from
    # 200 ms + twice the loaded round trip (the line's RTT and its standing queue): the flow
    # resumes at the first one after the line is back at 25 s.
    s = links.plan.wan_shaping[("a", "b")]
    srtt = 2 * DELAY_MS / 1000 + QUEUE_FILL["cubic"] * s.queue_bytes / cap
    rto = RTO_MIN_S + 2 * srtt
    k = math.ceil(math.log2((25 - 10) / rto + 1))
    resume = 10 + rto * (2**k - 1)
    assert 25 <= resume < 25 + 2 ** (k - 1) * rto
    assert resume + (size - 10 * cap) / cap < done < resume + (size - 10 * cap) / cap + 10 * 2 * DELAY_MS / 1000


def test_a_kept_connection_idle_past_its_timeout_starts_over_under_cubic_not_under_bbr() -> None:
    async def again_after_idle(links: LinkModel) -> float:
        cap = _goodput(links)
        conn = Conn(links.path("ha", "hc"))
        await _transfer(links, 20 * cap, conn=conn)  # its window grows to fill the line
        await asyncio.sleep(5)  # idle for many timeouts
        t0 = links.loop.time()
        await _transfer(links, 2 * cap, conn=conn)
        return links.loop.time() - t0

    times = {}
    for cc in ("cubic", "bbr"):
        loop, links = _model(congestion=cc)
        times[cc] = _run(loop, lambda links=links: again_after_idle(links))
    rtt = 2 * DELAY_MS / 1000
    assert times["bbr"] == pytest.approx(2.0, abs=1e-6)  # at the rate it had measured
    assert 2.0 + rtt < times["cubic"] < 2.0 + 8 * rtt  # a window of 10 segments grown again


def test_loss_costs_a_cubic_flow_its_mathis_limit_and_a_bbr_flow_what_it_resends() -> None:
    loop, links = _model(loss_pct=1.0, congestion="bbr")
    size = 5 * _goodput(links)
    assert 5 / 0.99 < _run(loop, lambda: _transfer(links, size)) < 5 / 0.99 + 0.15  # + handshake and startup
    loop, links = _model(loss_pct=1.0)
    rtt, mss = 2 * DELAY_MS / 1000, links.plan.wan_frame_mtu - TCP_IP_HEADERS
    limit = 1.22 * mss / (rtt * math.sqrt(0.01))
    assert limit < _goodput(links)
    size = 100 * limit
    done = _run(loop, lambda: _transfer(links, size))
    assert done == pytest.approx(size / limit, rel=0.05)


def test_a_flow_that_moves_nothing_for_its_timeout_fails() -> None:
    loop, links = _model()

    async def main() -> None:
        loop.call_later(1.0, links.impair, ("a", "b"), True)
        conn = Conn(links.path("ha", "hc"))
        await links.send(conn, 100 * _goodput(links), timeout_s=5.0)

    with pytest.raises(TimeoutError, match="took nothing for 5 s"):
        _run(loop, main)


def test_a_loop_where_nothing_can_happen_says_so() -> None:
    loop = VirtualLoop()

    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Stalled):
        _run(loop, main)


# ------------------------------------------------------------------ the broker
def _broker() -> tuple[VirtualLoop, LinkModel, SimBroker]:
    loop, links = _model()
    return loop, links, SimBroker(links, "hb")


def test_the_broker_keeps_a_session_while_its_client_is_away_and_publishes_a_killed_clients_will() -> None:
    loop, links, broker = _broker()
    got: list[tuple[str, bytes]] = []

    async def main() -> None:
        will = aiomqtt.Will("w/status", b"dead", qos=1, retain=True)
        reader = broker.client("hc", "reader", 5, None)
        async with reader as c:
            await c.subscribe("w/#")
        worker = broker.client("hc", "worker", 5, will)
        async with worker as w:  # the reader is away: its session queues what comes
            await w.publish("w/data", b"1")
            await asyncio.sleep(1)
        worker2 = broker.client("hc", "worker", 5, will)
        await worker2.__aenter__()
        worker2.kill()  # ends without a goodbye: its will, retained
        await asyncio.sleep(1)
        async with reader as c:
            async with asyncio.timeout(1):
                async for m in c.messages:
                    got.append((m.topic, m.payload))
                    if len(got) == 2:
                        break
        late = broker.client("ha", "late", 5, None)
        async with late as c:
            await c.subscribe("w/status")  # the retained will is handed to a new subscriber
            async with asyncio.timeout(1):
                async for m in c.messages:
                    got.append((m.topic, m.payload))
                    break

    _run(loop, main)
    assert got == [("w/data", b"1"), ("w/status", b"dead"), ("w/status", b"dead")]


def test_a_session_lives_through_a_broker_restart_and_sends_what_it_held() -> None:
    """``Session`` (the components' own) over the simulator's broker: a restart drops every
    connection; the session reconnects by itself and what was published meanwhile arrives."""
    loop, links, broker = _broker()
    got: list[bytes] = []

    async def main() -> None:
        stop = asyncio.Event()
        sub = Session(broker.client("ha", "sub", 5, None), ["t/#"], "sub")  # type: ignore[arg-type]
        pub = Session(broker.client("hc", "pub", 5, None), [], "pub")  # type: ignore[arg-type]

        async def on_message(m: Any) -> None:
            got.append(m.payload)

        async def nothing(first: bool) -> None:
            return None

        tasks = [asyncio.ensure_future(s.run(on_message, nothing, stop)) for s in (sub, pub)]
        await asyncio.sleep(1)
        await pub.publish("t/x", b"before")
        await asyncio.sleep(1)
        broker.stop()
        await pub.publish("t/x", b"while down")  # held by the client
        loop.call_later(2.0, broker.start)
        await asyncio.sleep(5)
        await pub.publish("t/x", b"after")
        await asyncio.sleep(1)
        assert sub.reconnects == 1 and pub.reconnects == 1 and pub.held == 1
        stop.set()
        await asyncio.gather(*tasks)

    _run(loop, main)
    assert got == [b"before", b"while down", b"after"]


def test_a_bbr_flow_busy_for_ten_seconds_probes_its_minimum_rtt() -> None:
    """PROBE_RTT every 10 s of a queue never empty: 200 ms + a round trip at 4 segments."""
    loop, links = _model(congestion="bbr")
    cap = _goodput(links)
    rtt = 2 * DELAY_MS / 1000
    done = _run(loop, lambda: _transfer(links, 25 * cap))
    # Handshake, then 25 s of data with two probes (at 10 and ~20.2 s), each costing ~0.23 s.
    assert done == pytest.approx(rtt + 25 + 2 * (0.2 + rtt), abs=0.05)


@pytest.mark.parametrize("congestion", ["bbr", "cubic"])
def test_a_flow_held_behind_a_saturated_line_for_an_hour_keeps_a_bounded_window(congestion: str) -> None:
    """40 transfers share the line for an emulated hour (one held back the whole time): the
    line never idles, so the last ends when it has carried them all; no window ever exceeds
    what the path holds (a BBR probe's four segments once doubled a window thousands of
    times over an hour, until it overflowed a float and ended every prefill worker)."""
    loop, links = _model(congestion=congestion)
    cap = _goodput(links)
    rtt = 2 * DELAY_MS / 1000
    n, each = 40, 90 * cap  # 3,600 s of the line's bytes
    widest = [0.0]

    async def main() -> list[float]:
        tasks = [asyncio.ensure_future(_transfer(links, each)) for _ in range(n)]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=5.0)
            widest[0] = max([widest[0], *(f.conn.cwnd for f in links.flows.active)])
        return [t.result() for t in tasks]

    ends = _run(loop, main)
    path = links.path("ha", "hc")
    assert math.isfinite(widest[0]) and INITIAL_WINDOW <= widest[0] <= path.max_cwnd
    assert max(ends) == pytest.approx(n * each / cap + rtt, rel=1e-3)
    # The bound is the path's: bandwidth-delay product and buffers, in segments.
    assert path.max_cwnd == pytest.approx(max(INITIAL_WINDOW, (cap * rtt + sum(
        lk.queue_bytes for lk in path.links if lk.capacity)) / path.mss))


def test_a_bug_in_the_link_model_fails_the_transfers_in_progress_not_the_loop() -> None:
    """An exception while the model moves its flows on fails each transfer in progress with
    it named (their requests fail; the senders go on) and reaches the loop's handler."""
    loop, links = _model()
    cap = _goodput(links)
    seen: list[str] = []
    loop.set_exception_handler(lambda _, ctx: seen.append(repr(ctx.get("exception"))))

    real_cap = links.flows._cap

    def broken(f: Any, now: float) -> float:  # once, at the next event of the model
        links.flows._cap = real_cap  # type: ignore[method-assign]
        raise OverflowError("int too large to convert to float")

    async def main() -> list[BaseException | float]:
        tasks = [asyncio.ensure_future(_transfer(links, 10 * cap)) for _ in range(3)]
        await asyncio.sleep(1.0)
        links.flows._cap = broken  # type: ignore[method-assign]
        links.set_rate(("a", "b"), RATE_MBIT * 1e6)  # the model reschedules every flow
        out: list[BaseException | float] = list(await asyncio.gather(*tasks, return_exceptions=True))
        out.append(await _transfer(links, cap))  # the model goes on
        return out

    out = _run(loop, main)
    assert all(isinstance(e, RuntimeError) and "the link model failed: OverflowError" in str(e) for e in out[:3]), out
    assert isinstance(out[3], float)
    assert seen and "OverflowError" in seen[0]
