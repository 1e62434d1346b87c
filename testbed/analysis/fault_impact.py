"""What each fault of a run cost: how soon the router noticed, how many requests it took down,
how much of their output was lost, and when requests stopped failing.

Times are emulated seconds from the fault's application. A fault's window runs from its
application to the next fault's (or the run's end); what ends in it is charged to it.

* ``detected_s``: a ``kill`` fault's worker declared dead by the router (``WorkerDeath``);
  from then on no request is planned onto it, so it is also when routing moved away. None:
  never declared (a router without health checks, ``workers.failure_detection: none``).
* ``affected``: requests with an attempt in flight when the fault landed or sent in its window
  until ``recovered_s``; ``failed``: of those, the ones that ended failed after every retry.
* ``goodput_lost``: the share of the affected requests' output tokens never delivered.
* ``recovered_s``: when the last attempt that failed in the window ended (None: nothing failed).
"""

from __future__ import annotations

from pydantic import BaseModel

from testbed.deploy.run_record import ClientRecord, PolicyRun


class FaultImpact(BaseModel):
    fault: str
    kind: str = ""
    detected_s: float | None = None
    affected: int = 0
    failed: int = 0
    failed_attempts: int = 0
    goodput_lost: float = 0.0
    recovered_s: float | None = None


def _attempts(r: ClientRecord) -> list[tuple[float, float | None, str | None]]:
    """Every attempt of a request: (sent, ended, error), client clock."""
    last_sent = r.attempt_sent or (r.sent if not r.retried else 0.0)
    return [*((a.sent, a.ended, a.error) for a in r.retried), (last_sent, r.ended, r.error)]


def fault_impacts(run: PolicyRun, dilation: float) -> list[FaultImpact]:
    applied = sorted((f for f in run.faults if f.applied_s is not None and f.error is None),
                     key=lambda f: f.applied_s or 0.0)
    t0, d = run.fault_t0, dilation
    out = []
    for i, f in enumerate(applied):
        assert f.applied_s is not None
        start = t0 + f.applied_s * d
        end = t0 + applied[i + 1].applied_s * d if i + 1 < len(applied) else float("inf")  # type: ignore[operator]
        host = f.fault.partition("host=")[2].split(",")[0] if f.kind == "kill" else ""
        death = next((x for x in run.deaths if x.worker == host and start <= x.t < end), None)
        failed_ends = [e for r in run.recs.values() for s, e, err in _attempts(r)
                       if err is not None and e is not None and start <= e < end]
        recovered = max(failed_ends, default=None)
        until = recovered if recovered is not None else start
        affected = [r for r in run.recs.values() if r.sent and any(
            s and (s <= start < (e or float("inf")) or start <= s <= until) for s, e, _ in _attempts(r))]
        lost = sum(r.max_new for r in affected if not r.ok)  # a failed answer is worth nothing, whole or in part
        out.append(FaultImpact(
            fault=f.fault, kind=f.kind, detected_s=None if death is None else (death.t - start) / d,
            affected=len(affected), failed=sum(not r.ok for r in affected), failed_attempts=len(failed_ends),
            goodput_lost=lost / max(1, sum(r.max_new for r in affected)),
            recovered_s=None if recovered is None else (recovered - start) / d))
    return out
