"""Which workers a reader takes a request's tokens from: the ones the router named for it.

A token batch arrives on its worker's own topic (``stream/<worker>``, which the broker's ACL
lets only that worker write), so who sent a chunk is known; what a reader must not believe
is that any worker may speak for any request. When the router plans a request it says, on
the request's own topic (``tokens/<rid>``, which only the router writes) and before it
commands a worker, which workers will stream it (``Tokens.streamers``). ``StreamGate``
hands the replay client and ``serve`` the chunks of their own requests from those workers
alone; a chunk from any other worker, or a malformed batch from one, ends nothing of the
request: it is refused and logged once per request and worker.

MQTT orders messages per publisher only: after a broker restart, two publishers' resends
may put a chunk before its request's announcement. Such a chunk waits, bounded by the
request's ``max_new`` tokens and as many chunks (a worker cannot make a reader hold more
than the request's own answer); one past that is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from protocol.messages import Tokens, rid_of, why_invalid
from protocol.refusals import refusal
from protocol.token_stream import TokenChunk, TokenStreamError, chunk_of, decode
from protocol.topics import Topics


@dataclass
class _Expected:
    max_new: int
    streamers: frozenset[str] | None = None  # None: not announced yet
    waiting: list[TokenChunk] = field(default_factory=list)
    waiting_tokens: int = 0
    refused_from: set[str] = field(default_factory=set)  # workers already logged for this request


class StreamGate:
    """The requests a reader waits for (``expect`` .. ``forget``) and who may stream each."""

    def __init__(self, topics: Topics, reader: str) -> None:
        self.topics, self.reader = topics, reader
        self._expected: dict[str, _Expected] = {}
        self.refused = 0  # chunks refused (a worker the router did not name, or past the bound)

    def expect(self, rid: str, max_new: int) -> None:
        self._expected[rid] = _Expected(max_new)

    def forget(self, rid: str) -> None:
        self._expected.pop(rid, None)

    def read(self, topic: str, payload: bytes | bytearray) -> list[TokenChunk]:
        """The chunks of one message that the reader may take, in order (and any that waited
        for the announcement this message is). Raises ``TokenStreamError`` naming only the
        expected requests its sender may speak for (the router always; a worker for the
        requests it was named for)."""
        prefix = self.topics.stream("")
        if topic.startswith(prefix):
            sender = topic[len(prefix):]
            try:
                worker, _, chunks = decode(payload)
            except TokenStreamError as e:
                raise TokenStreamError(str(e), [r for r in e.rids if self._speaks_for(sender, r)]) from None
            if worker != sender:
                raise TokenStreamError(f"token batch: worker {worker} on another worker's topic {topic}",
                                       [c.rid for c in chunks if self._speaks_for(sender, c.rid)])
            return [c for c in chunks if self._admit(sender, c)]
        try:
            t = Tokens.model_validate_json(payload)
        except ValidationError as e:
            rid = rid_of(payload)
            raise TokenStreamError(why_invalid(e), [rid] if rid in self._expected else []) from None
        if t.streamers is None:
            return [chunk_of(t)]
        exp = self._expected.get(t.rid)
        if exp is None:
            return []
        exp.streamers = frozenset(t.streamers)
        waited, exp.waiting, exp.waiting_tokens = exp.waiting, [], 0
        return [c for c in waited if self._admit(c.worker, c)]

    def _speaks_for(self, worker: str, rid: str) -> bool:
        exp = self._expected.get(rid)
        return exp is not None and exp.streamers is not None and worker in exp.streamers

    def _admit(self, sender: str, c: TokenChunk) -> bool:
        exp = self._expected.get(c.rid)
        if exp is None:
            return False  # not this reader's request (or one it has finished with)
        if exp.streamers is None:
            if exp.waiting_tokens + len(c.tokens) > exp.max_new or len(exp.waiting) >= exp.max_new + 1:
                self._refuse(sender, c.rid, "more than the request can hold came before the router named "
                                            "its workers")
                return False
            exp.waiting.append(c)
            exp.waiting_tokens += len(c.tokens)
            return False
        if sender in exp.streamers:
            return True
        self._refuse(sender, c.rid, f"not a worker the router named for it ({', '.join(sorted(exp.streamers))})")
        return False

    def _refuse(self, worker: str, rid: str, why: str) -> None:
        self.refused += 1
        exp = self._expected[rid]
        if worker not in exp.refused_from:
            exp.refused_from.add(worker)
            refusal(f"{self.reader}: refused tokens for {rid} from {worker}: {why}")
