"""What one deployment's run returns: the client's record of each request and the typed
``PolicyRun`` (client records, router records, worker statistics, the policy's counters, the
faults as applied, the fidelity verdict, CPU and memory of every process).

Load drivers produce ``ClientRecord``s, the ``Deployment`` wraps them into a ``PolicyRun``,
and the analysis reads it: the one type all three share, so none imports the others.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace

from protocol.router_config import Decision, PolicyReport, RequestRecord, WorkerDeath
from protocol.token_stream import TokenChunk
from protocol.worker_config import WorkerStats
from testbed.deploy.fidelity import Verdict
from testbed.deploy.process_sampling import ProcessMemory
from testbed.faults.timeline import AppliedFault
from testbed.traces.workload import RequestSpec


@dataclass(frozen=True)
class FailedAttempt:
    """One attempt of a request that failed and was retried (client clock)."""

    rid: str  # the id it was sent under
    sent: float
    ended: float
    error: str


@dataclass
class ClientRecord:
    rid: str
    prompt_len: int
    max_new: int
    sent: float = 0.0  # the first attempt's send: latencies include every retry, as a user waits through them
    ended: float | None = None  # when the request finished (completed or failed), client clock
    # Arrays, not lists: an emulated hour at token scale 1 streams 11.4 M tokens, whose ids and
    # arrival times as Python objects held ~0.9 GB of the client's memory (12 bytes a token
    # here: an id is 4, unsigned, as a token batch carries it).
    token_times: array[float] = field(default_factory=lambda: array("d"))
    tokens: array[int] = field(default_factory=lambda: array("I"))
    error: str | None = None
    done: bool = False
    workers: list[str] = field(default_factory=list)
    by_worker: dict[str, int] = field(default_factory=dict)  # tokens streamed by each worker
    # Chunks past a gap, by start index: disjoint ranges (an overlapping one is cut to what
    # is new), so it never holds more than ``max_new`` tokens, whatever a streamer repeats.
    early: dict[int, TokenChunk] = field(default_factory=dict)
    conflicts: int = 0  # chunks that disagreed with tokens already received at their indices
    retried: list[FailedAttempt] = field(default_factory=list)  # the failed attempts before the last one
    attempt_rid: str = ""  # the id the last attempt was sent under ("" : ``rid``)
    attempt_sent: float = 0.0  # when the last attempt was sent

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, array):
            self.tokens = array("I", self.tokens)
        if not isinstance(self.token_times, array):
            self.token_times = array("d", self.token_times)

    def drop_stream(self) -> None:
        """Forget the tokens received (and any held past a gap)."""
        self.token_times, self.tokens, self.early = array("d"), array("I"), {}

    @property
    def ok(self) -> bool:
        return self.done and self.error is None

    @property
    def last_rid(self) -> str:
        return self.attempt_rid or self.rid

    def retry(self, rid: str, now: float) -> None:
        """This attempt failed: keep it in ``retried`` and start over as request ``rid``."""
        assert self.error is not None
        self.retried.append(FailedAttempt(self.last_rid, self.attempt_sent or self.sent, now, self.error))
        self.attempt_rid, self.attempt_sent = rid, 0.0
        self.drop_stream()
        self.workers, self.by_worker = [], {}
        self.error, self.done = None, False

    def accept(self, t: TokenChunk, now: float) -> int:
        """Take one message of this request's token stream (received at ``now``); returns how
        many tokens it appended, in order. A repeat (QoS 1 delivers at least once: after a
        reconnection) is ignored, and of a chunk that runs past what we have only the new
        tail is taken; a chunk past a gap is held until the gap fills (two publishers, relay
        and main decoder, resending after a broker restart may arrive out of order; a gap
        that never fills ends with the caller's timeout). A chunk that disagrees with tokens
        already received, or runs past ``max_new``, is dropped and counted in ``conflicts``
        (``verify`` reports it): ``early`` holds disjoint ranges, at most ``max_new`` tokens in
        all (overlapping early chunks once held ~max_new^2/2)."""
        if self.done:
            return 0
        if t.error is not None:
            self.error, self.done = t.error, True
            return 0
        if t.start + len(t.tokens) > self.max_new:
            # Past the request's own length: no worker sends it (held in ``early``, a chunk so
            # far out would be kept for ever); a bug or a lie, counted like a disagreement.
            self.conflicts += 1
            return 0
        if t.start < len(self.tokens):  # a repeat, or one that runs past what we have
            had = self.tokens[t.start : t.start + len(t.tokens)].tolist()
            if t.tokens[: len(had)] != had:
                self.conflicts += 1  # two chunks disagree on an index: a bug upstream, never hidden
                return 0
            if len(had) == len(t.tokens):
                return 0
            t = replace(t, start=len(self.tokens), tokens=t.tokens[len(had):])
        if t.start > len(self.tokens):
            self._hold(t)
            return 0
        before = len(self.tokens)
        nxt: TokenChunk | None = t
        while nxt is not None:
            self.tokens.extend(nxt.tokens)
            self.token_times.extend([now] * len(nxt.tokens))
            if nxt.worker not in self.workers:
                self.workers.append(nxt.worker)
            self.by_worker[nxt.worker] = self.by_worker.get(nxt.worker, 0) + len(nxt.tokens)
            self.done = nxt.done
            nxt = None if self.done else self._held_next()
        return len(self.tokens) - before

    def _hold(self, t: TokenChunk) -> None:
        """Keep ``t`` (past a gap) as the parts of it no held chunk covers; a part that
        disagrees with a held one drops ``t`` as a conflict."""
        pieces = [t]
        for a, held in sorted(self.early.items()):
            b = a + len(held.tokens)
            cut: list[TokenChunk] = []
            for p in pieces:
                s, e = p.start, p.start + len(p.tokens)
                lo, hi = max(s, a), min(e, b)
                if lo >= hi:
                    cut.append(p)
                    continue
                if list(p.tokens[lo - s : hi - s]) != list(held.tokens[lo - a : hi - a]):
                    self.conflicts += 1
                    return
                if s < lo:
                    cut.append(replace(p, tokens=p.tokens[: lo - s], done=False))
                if hi < e:
                    cut.append(replace(p, start=hi, tokens=p.tokens[hi - s :]))
                elif p.done and e == b:
                    self.early[a] = replace(held, done=True)
            pieces = cut
        for p in pieces:
            if p.tokens or p.done:
                self.early[p.start] = p

    def _held_next(self) -> TokenChunk | None:
        """The held chunk that continues the tokens received (cut to what is new), if any;
        held chunks the tokens received now cover are checked and let go."""
        n = len(self.tokens)
        for a in sorted(k for k in self.early if k <= n):
            held = self.early.pop(a)
            b = a + len(held.tokens)
            if list(held.tokens[: min(b, n) - a]) != self.tokens[a : min(b, n)].tolist():
                self.conflicts += 1
                continue
            if b > n or held.done:
                return replace(held, start=n, tokens=held.tokens[n - a :])
        return None


@dataclass(frozen=True)
class LineBins:
    """KV bytes that crossed one WAN direction, counted where they cross (the delay line's tap
    behind the rate limiter, the link model as its flows move): TCP payload bytes
    per ``bin_s`` seconds from ``t0``, both on the client's clock (``ClientRecord.sent``)."""

    t0: float
    bin_s: float
    bytes: list[int]


@dataclass
class PolicyRun:
    """Everything one policy's deployment gave back, read before its network went down."""

    specs: list[RequestSpec]  # what was sent (a replay's input, or what the front door received)
    recs: dict[str, ClientRecord]
    router: dict[str, RequestRecord]
    workers: dict[str, WorkerStats]
    policy: PolicyReport
    verdict: Verdict
    impairment: str  # the WAN impairment backend that ran, and why
    faults: list[AppliedFault] = field(default_factory=list)
    wall_s: float = 0.0  # from the load's start to its end
    memory: list[ProcessMemory] = field(default_factory=list)  # when the driver asked for RSS samples
    rss: list[tuple[float, str, int, float]] = field(default_factory=list)  # (t, process, pid, MB)
    fault_t0: float = 0.0  # emulated time 0 of the fault timeline, on the stamp clock (``clock.now``)
    deaths: list[WorkerDeath] = field(default_factory=list)  # workers the router declared dead, in order
    engine: str = "emulation"  # what produced it: the emulation, or the simulator ("sim")
    wan_line: dict[str, LineBins] = field(default_factory=dict)  # "a->b" -> KV bytes as they crossed
    component_errors: list[str] = field(default_factory=list)  # uncaught in a component (the simulator)
    decisions: list[Decision] = field(default_factory=list)  # ``--trace-decisions``: each plan, what it weighed
