"""The faults of a run, as a report section: the timeline as applied and what each fault cost."""

from __future__ import annotations

from testbed.analysis.results import RunSummary
from testbed.analysis.tables import table_head


def fault_table(summary: RunSummary) -> str | None:
    """The fault timeline of each policy's run as applied (emulated seconds), and how many
    requests failed while each fault was in effect; None without faults."""
    lines = table_head(["policy", "fault", "applied s", "cleared s", "what was done", "failed during"])
    for name, s in summary.policies.items():
        for f in s.faults:
            during = sum(f.fault in (why or "") for why in s.failures.values())
            applied = f"{f.applied_s:.2f}" if f.applied_s is not None else "-"
            cleared = f"{f.cleared_s:.2f}" if f.cleared_s is not None else "-"
            lines.append(f"| {name} | `{f.fault}` | {applied} | {cleared} | {f.error or f.detail} | {during} |")
    if len(lines) == 2:
        return None
    lines += ["", "What each fault cost (emulated s from the fault; testbed/analysis/fault_impact.py): the router's "
              "verdict on a killed worker, the requests in flight or sent until the last failure, those that failed "
              "after every retry, their share of output tokens, and when requests stopped failing.", "",
              *table_head(["policy", "fault", "dead after s", "affected", "failed", "goodput lost",
                           "failing until s"])]
    for name, s in summary.policies.items():
        for m in s.fault_impact:
            detected = "-" if m.kind != "kill" else "never" if m.detected_s is None else f"{m.detected_s:.2f}"
            until = "-" if m.recovered_s is None else f"{m.recovered_s:.1f}"
            lines.append(f"| {name} | `{m.fault}` | {detected} | {m.affected} | {m.failed} | "
                         f"{100 * m.goodput_lost:.1f} % | {until} |")
    return "\n".join(lines)
