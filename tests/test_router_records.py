"""The router keeps only its latest finished requests in memory: older records go to the
records file as they leave, so a long run's memory stays flat and nothing is lost."""

from __future__ import annotations

from pathlib import Path

from protocol.router_config import RequestRecord, RouterConfig, WorkerEndpoint
from protocol.worker_config import BrokerInfo
from testbed.deploy.router import ENDED_KEPT, Router
from testbed.policies import RequestState
from testbed.policies.spec import parse_policy


def test_finished_records_stream_to_disk_and_memory_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    cfg = RouterConfig(run_id="t1", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("same-dc"), records_path=str(path),
                       workers={"decode-a": WorkerEndpoint(role="decode", dc="a", host="10.0.0.2", kv_port=7070)})
    router = Router(cfg)
    n = ENDED_KEPT + 904
    with path.open("w") as router.records:
        for i in range(n):
            router._finish(RequestState(f"r{i}", [1, 2, 3], 4, 0.0), None if i % 7 else "worker decode-a died")
            assert len(router.finished) <= ENDED_KEPT and len(router.ended) <= ENDED_KEPT
        on_disk = path.read_text().splitlines()
        assert len(on_disk) == n - ENDED_KEPT  # written as they left memory, not at the end
        while router.finished:
            router._write_record()
    recs = [RequestRecord.model_validate_json(line) for line in path.read_text().splitlines()]
    assert [r.rid for r in recs] == [f"r{i}" for i in range(n)]  # each once, in order
    assert recs[7].error == "worker decode-a died" and recs[8].error is None


def test_finished_requests_leave_memory_once_older_than_the_late_event_window(tmp_path: Path,
                                                                             monkeypatch) -> None:  # noqa: ANN001
    """Late events come within seconds: what ended more than ENDED_KEEP_S (emulated) ago is on
    disk only, however few requests that is, so a long run's router stays flat."""
    import testbed.deploy.router as router_mod

    path = tmp_path / "records.jsonl"
    cfg = RouterConfig(run_id="t2", broker=BrokerInfo(host="10.0.0.1", port=1883, username="r", password="p"),
                       policy=parse_policy("same-dc"), records_path=str(path), dilation=2.0,
                       workers={"decode-a": WorkerEndpoint(role="decode", dc="a", host="10.0.0.2", kv_port=7070)})
    router = Router(cfg)
    clock = [100.0]
    monkeypatch.setattr(router_mod.time, "monotonic", lambda: clock[0])
    with path.open("w") as router.records:
        for i in range(10):
            router._finish(RequestState(f"r{i}", list(range(1000)), 4, 0.0), None)
        clock[0] += router_mod.ENDED_KEEP_S * 2.0 - 1  # inside the window (x D)
        router._finish(RequestState("r10", [1], 4, 0.0), None)
        assert len(router.ended) == 11 and path.read_text() == ""
        clock[0] += 2
        router._finish(RequestState("r11", [1], 4, 0.0), None)
        assert set(router.ended) == set(router.finished) == set(router.ended_at) == {"r10", "r11"}
        assert [RequestRecord.model_validate_json(x).rid for x in path.read_text().splitlines()] == [
            f"r{i}" for i in range(10)]
