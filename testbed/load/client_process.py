"""The replay client as a process of its own, in the client host's namespace, without root.

The client parses what every worker streams: in the orchestrator's process (root) a flaw in
that parsing would be root's. ``testbed run`` starts it with ``netns.spawn``; it reads its
job (root's files, 0600: the broker credential, the requests) while still root, opens its
records file in its own folder (``out/client/``, its account's), becomes the client's
account (``testbed.deploy.accounts``) and replays. It tells the orchestrator on stdout when
the first request is due (``start <monotonic>``: the fault timeline and the sampling start
there) and its progress (``progress <n> <total> <failed>``), and writes every request's
record to ``records.jsonl`` (``ReplayedRequest``, a line each, as it ends; those the timeout
ended at the end). The orchestrator reads that file back without following links and
validates every line before anything uses it (``read_records``): the client is input like
any other.

The requests travel as a pickle that root wrote and only root and the client (still root)
read: a trace's prompts are recipes (``Prompt``), made into ids as each is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol import clock
from protocol.messages import StreamedId, why_invalid
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo, Contract, RunAs
from testbed.deploy.deployment import Deployment
from testbed.deploy.run_record import ClientRecord, FailedAttempt
from testbed.errors import TestbedError
from testbed.load.replay_client import ClientOptions, replay
from testbed.load.retry import RetryPolicy
from testbed.net import netns, runstate
from testbed.traces.workload import RequestSpec
from workers.privilege import Identity, OutDir, drop_privileges, no_new_privileges
from workers.transport import HOST

RECORDS_FILE = "records.jsonl"


class ClientJob(Contract):
    """What the orchestrator hands the client process (root's file, read while root)."""

    run_id: str
    broker: BrokerInfo
    specs_path: str  # a pickle of list[RequestSpec], root's
    out_dir: str  # the client's own folder (out/client/), owned by ``run_as``
    run_as: RunAs | None
    timeout_s: float
    router_grace_s: float
    retries: int
    initial_s: float
    max_s: float
    jitter: float
    backoff_scale: float


class _Attempt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = Field(max_length=160)
    sent: float
    ended: float
    error: str = Field(max_length=20_000)


class ReplayedRequest(BaseModel):
    """One request's record as the client process saw it end (client clock)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rid: str = Field(max_length=128)
    prompt_len: int = Field(ge=0)
    max_new: int = Field(ge=1)
    sent: float
    ended: float | None
    error: str | None = Field(max_length=20_000)
    done: bool
    tokens: list[StreamedId]
    token_times: list[float]
    workers: list[str] = Field(max_length=16)
    by_worker: dict[str, int] = Field(max_length=16)
    conflicts: int = Field(ge=0)
    retried: list[_Attempt] = Field(max_length=64)
    attempt_rid: str = Field(max_length=160)
    attempt_sent: float

    @classmethod
    def of(cls, rec: ClientRecord) -> ReplayedRequest:
        return cls(rid=rec.rid, prompt_len=rec.prompt_len, max_new=rec.max_new, sent=rec.sent, ended=rec.ended,
                   error=rec.error, done=rec.done, tokens=rec.tokens.tolist(), token_times=rec.token_times.tolist(),
                   workers=rec.workers, by_worker=rec.by_worker, conflicts=rec.conflicts,
                   retried=[_Attempt(rid=a.rid, sent=a.sent, ended=a.ended, error=a.error) for a in rec.retried],
                   attempt_rid=rec.attempt_rid, attempt_sent=rec.attempt_sent)

    def record(self) -> ClientRecord:
        return ClientRecord(self.rid, self.prompt_len, self.max_new, sent=self.sent, ended=self.ended,
                            token_times=self.token_times, tokens=self.tokens, error=self.error, done=self.done,
                            workers=self.workers, by_worker=self.by_worker, conflicts=self.conflicts,
                            retried=[FailedAttempt(a.rid, a.sent, a.ended, a.error) for a in self.retried],
                            attempt_rid=self.attempt_rid, attempt_sent=self.attempt_sent)


def read_records(text: str, source: str, specs: dict[str, int]) -> dict[str, ClientRecord]:
    """The client's records file, validated line by line against what was sent (``specs``:
    request id -> max_new): a record of a request never sent, twice, or with more tokens than
    the request may have is an error naming the line."""
    recs: dict[str, ClientRecord] = {}
    for n, line in enumerate(text.splitlines(), 1):
        try:
            r = ReplayedRequest.model_validate_json(line)
        except ValidationError as e:
            raise TestbedError(f"{source}:{n}: {why_invalid(e)}") from None
        if r.rid not in specs or r.rid in recs:
            raise TestbedError(f"{source}:{n}: rid: {r.rid} was {'not sent' if r.rid not in specs else 'already read'}")
        if r.max_new != specs[r.rid] or len(r.tokens) > r.max_new or len(r.token_times) != len(r.tokens):
            raise TestbedError(f"{source}:{n}: tokens: {len(r.tokens)} tokens at {len(r.token_times)} times for a "
                               f"request of {specs[r.rid]}")
        recs[r.rid] = r.record()
    return recs


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def run_client_process(dep: Deployment, specs: list[RequestSpec], opts: ClientOptions,
                       progress: Callable[[int, int, int], None] | None,
                       begin: Callable[[float], None]) -> dict[str, ClientRecord]:
    """The orchestrator's side: start the client process in ``dep``'s client host, pass on
    what it says (``begin`` once, progress), wait for it and read its records back. A
    request it left without a record ends with that reason."""
    run, cl = dep.net.run, dep.cluster
    specs_path = run.dir / "client.specs.pickle"
    runstate.write_private_bytes(specs_path, pickle.dumps(specs, protocol=pickle.HIGHEST_PROTOCOL))
    client = cl.accounts.of("client")
    r = opts.retry
    job = ClientJob(run_id=run.run_id, broker=dep.client_broker, specs_path=str(specs_path),
                    out_dir=str(cl.accounts.folder("client")), run_as=client, timeout_s=opts.timeout_s,
                    router_grace_s=opts.router_grace_s, retries=r.retries, initial_s=r.initial_s, max_s=r.max_s,
                    jitter=r.jitter, backoff_scale=opts.backoff_scale)
    job_path = run.dir / "client.cfg.json"
    runstate.write_private(job_path, job.model_dump_json())  # holds the client's broker credential
    proc = dep.net.spawn(dep.client_host, [sys.executable, "-m", "testbed.load.client_process", str(job_path)],
                         name="client", log=run.dir / "client.log", stdout=subprocess.PIPE)
    assert proc.stdout is not None
    started = False
    try:
        # What an unprivileged process says is read in bounded lines and checked.
        while line := proc.stdout.readline(256):
            words = line.decode(errors="replace").split()
            if words[:1] == ["start"] and not started and len(words) == 2:
                t0 = _float(words[1])
                if not (math.isfinite(t0) and abs(t0 - time.monotonic()) < 60):
                    raise TestbedError(f"the replay client said it started at {words[1]!r}, not a time of this host")
                started = True
                begin(t0)
            elif words[:1] == ["progress"] and progress is not None and len(words) == 4 \
                    and all(w.isdigit() and len(w) < 10 for w in words[1:]):
                progress(int(words[1]), int(words[2]), int(words[3]))
        rc = proc.wait()
    except BaseException:
        netns.stop_child(proc, 5)
        raise
    if rc != 0:
        raise TestbedError(f"the replay client failed (exit {rc}):\n{cl.log_tail('client')}")
    path = cl.accounts.folder("client") / RECORDS_FILE
    recs = read_records(runstate.read_nofollow(path), str(path), {s.rid: s.max_new for s in specs})
    # In the order they were given (the file has them as they ended).
    return {s.rid: recs.get(s.rid) or ClientRecord(s.rid, len(s.prompt), s.max_new, done=True,
                                                   error="the replay client kept no record of it") for s in specs}


def main(argv: list[str] | None = None) -> int:
    no_new_privileges()  # netns.spawn sets it before exec; this covers a start by hand
    ap = argparse.ArgumentParser(prog="python -m testbed.load.client_process")
    ap.add_argument("job", type=Path)
    args = ap.parse_args(argv)
    job = ClientJob.model_validate_json(args.job.read_text())
    with open(job.specs_path, "rb") as f:
        specs = pickle.load(f)  # root's file, read as root: the orchestrator wrote it
    out = OutDir(job.out_dir)
    clock.follow_steps(clock.steps_file(args.job), "client")  # a clock-step fault's
    records = os.fdopen(out.open(RECORDS_FILE, "w"), "w")
    drop_privileges(Identity(job.run_as.uid, job.run_as.gid) if job.run_as else None)
    written: set[str] = set()

    def ended(rec: ClientRecord) -> None:
        records.write(ReplayedRequest.of(rec).model_dump_json() + "\n")
        records.flush()
        written.add(rec.rid)
        # Saved: what it streamed leaves memory (a soak judges this process's memory too).
        rec.drop_stream()

    def progress(n: int, total: int, failed: int) -> None:
        print(f"progress {n} {total} {failed}", flush=True)

    def started(t0: float) -> None:
        print(f"start {t0!r}", flush=True)

    gc.collect()
    gc.freeze()  # the client timestamps tokens: no full collections over what it built to start
    opts = ClientOptions(job.timeout_s, job.router_grace_s,
                         RetryPolicy(job.retries, job.initial_s, job.max_s, job.jitter), job.backoff_scale)
    try:
        recs = asyncio.run(replay(HOST, job.broker, Topics(job.run_id), specs, opts, progress, started, ended))
    except Exception as e:  # noqa: BLE001 - the orchestrator shows this log's tail
        print(f"client: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    for rec in recs.values():
        if rec.rid not in written:  # ended by the client's timeout
            ended(rec)
    records.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
