"""The MQTT topic layout of a run: which topic carries what, between whom.

Every topic lives under ``pdd/<run_id>/``. QoS 1 for requests, commands, events and
tokens; MQTT keeps per-topic order for one publisher, so one worker's token stream (its own
topic) arrives in order, and a request's stream that moves from a relay to its main decoder
is put back in order by the receiver (``ClientRecord.accept``).

    client/requests            client  -> router   Request
    worker/<name>/cmd          router  -> worker   PrefillCmd | DecodeCmd | CancelCmd | HandoffCmd
    worker/<name>/from/<peer>  RLD     -> MD       ExtendCmd (eager token IDs)
                               MD      -> RLD      HandoffAck (a catch-up batch is extended)
                               (each decoder writes only its own ``from/<name>``, and only
                               these two, for a request that names it as the partner)
    worker/<name>/status       worker  -> router   Status (retained; last will = dead)
    worker/<name>/events       worker  -> router   Event: PrefillDone | KvSent | KvReceived |
                                                   HandoffSent | Extended | Done | Failed
    stream/<worker>            worker  -> client   a token batch: one binary message per step
                                                   carrying every request's new tokens
                                                   (``protocol/token_stream.py``)
    tokens/<rid>               router  -> client   Tokens: which workers stream the request (sent
                                                   before they are told), or a failure the
                                                   router reports itself
    router/status              router  -> client   RouterStatus (retained)

The broker's ACL (``testbed.deploy.broker``) lets each component write only its own
topics, so a message's topic says who sent it.
"""

from __future__ import annotations


class Topics:
    def __init__(self, run_id: str) -> None:
        self.root = f"pdd/{run_id}"

    @property
    def requests(self) -> str:
        return f"{self.root}/client/requests"

    @property
    def cancels(self) -> str:
        return f"{self.root}/client/cancels"

    def cmd(self, worker: str) -> str:
        return f"{self.root}/worker/{worker}/cmd"

    def peer(self, worker: str, sender: str) -> str:  # only ``sender`` may write here (the ACL)
        return f"{self.root}/worker/{worker}/from/{sender}"

    def peers_of(self, worker: str) -> str:
        return f"{self.root}/worker/{worker}/from/+"

    def status(self, worker: str) -> str:
        return f"{self.root}/worker/{worker}/status"

    @property
    def all_status(self) -> str:
        return f"{self.root}/worker/+/status"

    def events(self, worker: str) -> str:  # only that worker may write here (the ACL): the topic says who
        return f"{self.root}/worker/{worker}/events"

    @property
    def all_events(self) -> str:
        return f"{self.root}/worker/+/events"

    def tokens(self, rid: str) -> str:
        return f"{self.root}/tokens/{rid}"

    @property
    def all_tokens(self) -> str:
        return f"{self.root}/tokens/+"

    def stream(self, worker: str) -> str:
        return f"{self.root}/stream/{worker}"

    @property
    def all_streams(self) -> str:
        return f"{self.root}/stream/+"

    @property
    def router_status(self) -> str:
        return f"{self.root}/router/status"
