"""The requests a router has finished: in memory while their late events may still come, and
one JSON line each in the run's records file as each ends (a router killed loses none of
them, only late events), written again as it leaves memory if late events came meanwhile
(a reader keeps a request's last line).

Late events come within seconds (a cut-off transfer's report, KV kept for a main decoder's
cache, a broker restart's resent request), so a finished request stays for ``ENDED_KEEP_S``
emulated seconds, at most ``ENDED_KEPT`` of them; older ones are on disk, and the router's
memory does not grow with the run (a count alone let a 30-minute soak's router grow from 41
to 229 MB: every prompt kept).
"""

from __future__ import annotations

import asyncio
from typing import TextIO

from protocol import clock
from protocol.messages import Event, Failed, KvSent, PrefillDone
from protocol.refusals import refusal
from protocol.router_config import RequestRecord
from testbed.policies import RequestState
from testbed.policies.base import WorkerView

ENDED_KEEP_S = 30.0
ENDED_KEPT = 4096
# Emulated seconds a stopping router keeps listening while finished requests' KV is still on
# its way to their main decoders (PDD's transfers that outlive the request: kept for the
# decoder's cache, or cut off and not yet reported). Stopped at once, a run's last ones were
# missing from the table while the WAN's counters had them (a short PDD run: 5 % of its KV).
SETTLE_S = 20.0
SETTLE_POLL_S = 0.05


class Ended:
    def __init__(self, dilation: float) -> None:
        self.dilation = dilation
        self.records: dict[str, RequestRecord] = {}  # rid -> record (late events land in it)
        self.states: dict[str, RequestState] = {}  # rid -> request, for the policy's late events
        self.at: dict[str, float] = {}  # rid -> clock.monotonic() it ended, oldest first
        self.file: TextIO | None = None  # the records file, a line per request as it leaves memory
        self.cut = False  # the last write was refused: it may have left half a line
        self.written: dict[str, int] = {}  # rid -> events its last line on disk holds

    def __contains__(self, rid: str) -> bool:
        return rid in self.records

    def add(self, req: RequestState, rec: RequestRecord) -> None:
        """``req`` ended with ``rec``; what is past the window goes to disk."""
        self.records[req.rid] = rec
        self.states[req.rid] = req
        if self._write(req.rid):
            self.written[req.rid] = len(rec.events)
        now = clock.monotonic()
        self.at[req.rid] = now
        horizon = now - ENDED_KEEP_S * self.dilation
        while self.at and (len(self.at) > ENDED_KEPT or next(iter(self.at.values())) < horizon):
            if not self.write_oldest():
                break  # the disk refused it: kept, and tried again with the next ended request

    def write_oldest(self) -> bool:
        """The oldest finished request's record to disk, then out of memory; False (and kept)
        when the disk refused it (a full tmpfs: a record is never dropped before it is written)."""
        rid = next(iter(self.records))
        if self.written.get(rid) != len(self.records[rid].events) and not self._write(rid):
            return False
        self.written.pop(rid, None)
        del self.records[rid]
        self.states.pop(rid, None)
        self.at.pop(rid, None)
        return True

    def _write(self, rid: str) -> bool:
        if self.file is None:  # not open yet (a router that has not started): written as it leaves
            return False
        try:
            # After a refused write, a fresh line: the refused one may have left half a line.
            self.file.write(("\n" if self.cut else "") + self.records[rid].model_dump_json() + "\n")
            self.file.flush()
        except OSError as e:
            self.cut = True
            refusal(f"router: the record of {rid} not written yet: {e}")
            return False
        self.cut = False
        return True

    def write_all(self) -> None:
        while self.records and self.write_oldest():
            pass

    def kv_on_its_way(self, workers: dict[str, WorkerView]) -> bool:
        """A finished request whose prefill computed it and has not yet reported its KV
        transfer (sent, cut off or failed) to a decoder that takes it after the request's end
        (a main decoder behind a relay, a holder), both of them up."""
        for rec in self.records.values():
            late = [*rec.hold, *([rec.decode] if rec.relay and rec.decode and rec.decode != rec.relay else [])]
            if not late or not any(isinstance(e, PrefillDone) for e in rec.events):
                continue
            for decoder in late:
                if not all(w in workers and workers[w].up for w in (rec.prefill, decoder)):
                    continue  # a dead end's transfer is lost with it, not on its way
                if not any(_reports_kv_to(e, decoder) for e in rec.events):
                    return True
        return False

    async def settle(self, workers: dict[str, WorkerView]) -> None:
        """Until no KV is on its way (``kv_on_its_way``), at most ``SETTLE_S`` emulated s."""
        deadline = clock.monotonic() + SETTLE_S * self.dilation
        while self.kv_on_its_way(workers) and clock.monotonic() < deadline:
            await asyncio.sleep(SETTLE_POLL_S * self.dilation)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.states.values())


def _reports_kv_to(ev: Event, decoder: str) -> bool:
    """``ev`` is a prefill's last word on its KV transfer to ``decoder``."""
    return (isinstance(ev, KvSent) and ev.to == decoder) or (isinstance(ev, Failed) and ev.target == decoder)
