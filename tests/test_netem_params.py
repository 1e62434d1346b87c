"""The qdiscs the netem backend would build, computed without a kernel (this one has no
netem): queue limit from the buffer, the rate and the delay; jitter without reordering."""

from __future__ import annotations

from typing import Any

import pytest

from testbed.net import shaping
from testbed.net.plan import FRAME_OVERHEAD, Shaping


class RecordingIPRoute:
    """Stands in for pyroute2's IPRoute: records every tc call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def link_lookup(self, ifname: str) -> list[int]:
        return [7]

    def tc(self, command: str, kind: str, **kw: Any) -> None:
        self.calls.append((command, kind, kw))


def _shaping(rate_mbit: float | None, delay_ms: float, jitter_ms: float = 0.0, queue_bytes: int = 0) -> Shaping:
    rate = int(rate_mbit * 1e6) if rate_mbit else None
    return Shaping(rate_bps=rate, burst_bytes=65536, queue_bytes=queue_bytes, delay_ms=delay_ms,
                   jitter_ms=jitter_ms, loss_pct=0.5)


def test_netem_limit_holds_the_buffer_and_every_frame_in_flight() -> None:
    mtu = 9000
    frame = mtu + FRAME_OVERHEAD
    # 1 Gbit/s, 20 ms + 2 ms jitter, a 2.5 MB buffer: 2.5 MB + 125 MB/s x 22 ms = 5.25 MB.
    p = shaping.netem_params(_shaping(1000, 20.0, 2.0, queue_bytes=2_500_000), mtu)
    assert p.limit_packets == -(-(2_500_000 + 2_750_000) // frame)
    assert (p.delay_us, p.jitter_us, p.loss_pct, p.fifo_child) == (20_000, 2_000, 0.5, True)
    # No jitter: nothing to reorder, no fifo child. Unshaped: netem's default limit.
    assert not shaping.netem_params(_shaping(1000, 20.0, queue_bytes=1), mtu).fifo_child
    assert shaping.netem_params(_shaping(None, 20.0), mtu).limit_packets == 1000
    # A small buffer on a slow line is not rounded up to a thousand packets (~65 MB at MTU 65000).
    slow = shaping.netem_params(_shaping(10, 5.0, queue_bytes=12_500), 65000)
    assert slow.limit_packets == 1


@pytest.mark.parametrize("jitter", [0.0, 3.0])
def test_netem_backend_builds_htb_then_netem_then_fifo(jitter: float) -> None:
    ipr = RecordingIPRoute()
    s = _shaping(100, 10.0, jitter, queue_bytes=250_000)
    shaping.add_wan_qdiscs(ipr, "wan0", s, 1500, use_netem=True)  # type: ignore[arg-type]
    kinds = [(c, k, kw.get("parent")) for c, k, kw in ipr.calls]
    want = [("add", "htb", None), ("add-class", "htb", "1:"), ("add", "netem", "1:10")]
    if jitter:
        want.append(("add", "pfifo", "10:"))
    assert kinds == want
    netem = ipr.calls[2][2]
    p = shaping.netem_params(s, 1500)
    assert (netem["delay"], netem["jitter"], netem["limit"]) == (10_000, int(jitter * 1000), p.limit_packets)
    if jitter:
        assert ipr.calls[3][2]["limit"] == p.limit_packets


def test_delay_line_backend_builds_only_the_rate_and_its_byte_buffer() -> None:
    ipr = RecordingIPRoute()
    shaping.add_wan_qdiscs(ipr, "wan0", _shaping(100, 10.0, 3.0, queue_bytes=250_000), 1500,  # type: ignore[arg-type]
                           use_netem=False)
    assert [(c, k) for c, k, _ in ipr.calls] == [("add", "htb"), ("add-class", "htb"), ("add", "bfifo")]
    assert ipr.calls[2][2]["limit"] == 250_000


def test_faults_change_netem_and_htb_in_place() -> None:
    """What a fault does where netem exists: a direction down is 100 % loss, a delay spike
    raises netem's delay and its limit (more frames in flight), a rate drop changes the htb
    class; each a ``change`` of the qdisc the build added, never a rebuild."""
    ipr = RecordingIPRoute()
    s = _shaping(100, 10.0, 0.0, queue_bytes=250_000)
    shaping.change_netem(ipr, "wan0", s, 1500, loss_pct=100.0)  # type: ignore[arg-type]
    shaping.change_netem(ipr, "wan0", s, 1500, extra_delay_ms=40.0)  # type: ignore[arg-type]
    shaping.change_rate(ipr, "wan0", 10_000_000, s.burst_bytes)  # type: ignore[arg-type]
    (c1, k1, down), (c2, _, slow), (c3, k3, rate) = ipr.calls
    assert (c1, k1, down["parent"], down["handle"]) == ("change", "netem", "1:10", "10:")
    assert down["loss"] == 100.0 and down["delay"] == 10_000
    assert c2 == "change" and slow["delay"] == 50_000 and slow["loss"] == 0.5  # the configured loss stays
    assert slow["limit"] > down["limit"] == shaping.netem_params(s, 1500).limit_packets
    assert (c3, k3, rate["handle"], rate["rate"], rate["ceil"]) == ("change-class", "htb", "1:10", "10000000bit",
                                                                   "10000000bit")


def test_goodput_fit_weighs_a_burst_at_the_window_edge_by_its_share() -> None:
    """A delay line descheduled for 150 ms as the window opens releases those frames inside
    it: two end points would read 7.5 % high, the fitted slope stays within 2 %."""
    from testbed.net.measure import _slope

    rate = 62.5e6  # bytes/s (500 Mbit/s)
    times = [i * 0.01 for i in range(201)]
    counter = [int(rate * t) for t in times]
    # The counter lags 150 ms of traffic when the window opens and catches up within 20 ms.
    counter[0] -= int(rate * 0.15)
    counter[1] -= int(rate * 0.075)
    end_points = (counter[-1] - counter[0]) / (times[-1] - times[0])
    assert end_points > 1.07 * rate
    assert abs(_slope(list(zip(times, counter, strict=True))) - rate) < 0.02 * rate
    assert _slope([(0.0, 5)]) == 0.0
