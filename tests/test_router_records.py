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
