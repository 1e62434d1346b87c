"""A served session saved as a run directory, the same files ``testbed run`` writes.

The requests the front end received become rows like a replay's (``RequestSpec`` +
``ClientRecord`` + the router's ``RequestRecord``): times are taken where the front end
sits (sent when it published the request, each token when it reached it), in emulated
seconds as everywhere; ``summary.json``'s trace says where they came from (the URL).
An external client's own measurement of the same requests is set beside these by
``testbed.serve.compare``.

While it serves, the front end keeps only the requests in flight: each one is written to
``served.jsonl`` as it ends (``ServedRequest``, one line; its prompt's length, not its
tokens) and the orchestrator reads the file back when the server stops, so memory does not
grow with the requests served.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol import clock
from protocol.messages import RequestHints, StreamedId, why_invalid
from testbed.analysis import report
from testbed.analysis.metrics import Slo
from testbed.analysis.policy_summary import measure
from testbed.analysis.results import RunSummary, TraceInfo
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.run_record import ClientRecord, PolicyRun
from testbed.errors import TestbedError
from testbed.policies import PolicySpec
from testbed.scenario import Scenario
from testbed.serve.compare import UNIX_MINUS_STAMP
from testbed.traces.workload import RequestSpec

SERVED_FORMAT = "openai-http"
SERVED_FILE = "served.jsonl"


class ServedRequest(BaseModel):
    """One request the front end served, as it ended (front end's clock)."""

    model_config = ConfigDict(extra="forbid")

    rid: str
    prompt_len: int
    max_new: int
    at: float  # seconds after the server started
    hints: RequestHints
    sent: float
    ended: float | None
    error: str | None
    tokens: list[StreamedId]
    token_times: list[float]
    workers: list[str]
    by_worker: dict[str, int]
    conflicts: int

    @classmethod
    def of(cls, spec: RequestSpec, rec: ClientRecord) -> ServedRequest:
        return cls(rid=rec.rid, prompt_len=rec.prompt_len, max_new=rec.max_new, at=spec.at, hints=spec.hints,
                   sent=rec.sent, ended=rec.ended, error=rec.error, tokens=rec.tokens.tolist(),
                   token_times=rec.token_times.tolist(), workers=rec.workers, by_worker=rec.by_worker,
                   conflicts=rec.conflicts)

    def spec(self) -> RequestSpec:
        return RequestSpec(rid=self.rid, prompt=[], max_new=self.max_new, at=self.at, hints=self.hints)

    def record(self) -> ClientRecord:
        return ClientRecord(self.rid, self.prompt_len, self.max_new, sent=self.sent, ended=self.ended,
                            token_times=self.token_times, tokens=self.tokens, error=self.error, done=True,
                            workers=self.workers, by_worker=self.by_worker, conflicts=self.conflicts)


def write_served(out: IO[str], spec: RequestSpec, rec: ClientRecord) -> None:
    out.write(ServedRequest.of(spec, rec).model_dump_json() + "\n")
    out.flush()


def parse_served(text: str, source: str) -> tuple[list[RequestSpec], dict[str, ClientRecord]]:
    """What ``write_served`` wrote, validated line by line: the front end that wrote it parsed
    what clients sent, so its file is input like any other (an error names ``source``'s line)."""
    specs: list[RequestSpec] = []
    recs: dict[str, ClientRecord] = {}
    for n, line in enumerate(text.splitlines(), 1):
        try:
            served = ServedRequest.model_validate_json(line)
        except ValidationError as e:
            raise TestbedError(f"{source}:{n}: {why_invalid(e)}") from None
        if served.rid in recs:
            raise TestbedError(f"{source}:{n}: rid: {served.rid} was already served")
        specs.append(served.spec())
        recs[served.rid] = served.record()
    return specs, recs


def save_served(out: Path, sc: Scenario, plan: EmulationPlan, policy: PolicySpec, run: PolicyRun, url: str,
                slo: Slo | None = None) -> list[Path]:
    df, summary = measure(sc, policy, plan, run, slo or Slo())
    info = TraceInfo(trace=url, format=SERVED_FORMAT, requests=len(run.specs), token_scale=plan.scales.s_in,
                     block_size=sc.workers.block_size,
                     # The records' stamps are on the host's monotonic clock; an external client's
                     # (aiperf's) on the wall clock: what to add to match them (``compare``).
                     meta={"served_by": "testbed serve", UNIX_MINUS_STAMP: time.time() - clock.now()})
    run_summary = RunSummary(trace=info, speed=1.0, limit=None, window=None, emulation=plan.summary(sc),
                             scenario=sc, policies={policy.label: summary}, workers={policy.label: run.workers})
    return report.save(out, {policy.label: df}, run_summary)
