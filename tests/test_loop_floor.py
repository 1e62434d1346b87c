"""The event loop's floor (``testbed/bench/loop_floor.py``), which ``make bench-sim`` prints
beside the simulator's rate: it runs the steps it prices, and the bound follows from it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from testbed.bench import loop_floor, sim_speed

pytestmark = pytest.mark.unit


def test_the_floor_runs_every_step_in_virtual_time(monkeypatch: pytest.MonkeyPatch) -> None:
    ends: list[float] = []
    real = loop_floor._steps

    async def counted(n: int) -> None:
        await real(n)
        ends.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(loop_floor, "_steps", counted)
    us = loop_floor.floor_us_per_step(2000)
    assert us > 0
    # 2,000 paced steps and the last token's hop: the clock jumped, the host did not wait.
    assert ends == [pytest.approx(2000 * loop_floor.STEP_S + loop_floor.HOP_S)]


def test_the_bound_is_the_floor_times_the_steps_a_request_took(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    workers = {"decode-b1": {"steps": 3000}, "prefill-1": {"steps": 1000}}
    (tmp_path / "summary.json").write_text(json.dumps({"policies": {"pdd": {"fidelity": {"workers": workers}}}}))
    monkeypatch.setattr(sim_speed, "floor_us_per_step", lambda: 25.0)
    line = sim_speed.loop_floor_line(tmp_path, 10)
    assert "25.0 us a step" in line and "took 400 steps" in line and "exceeds 100 requests/s" in line
