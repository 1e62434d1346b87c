"""The trace replayer as a load driver: requests at their times from the client host.

``TraceReplay`` sends a list of ``RequestSpec`` (times already in real seconds) through
the replay client inside the deployment's client host (in an emulation a process of its
own, without root: ``testbed.load.client_process``), with progress on stderr, and returns
the client's record of each request. A failed request is retried as the
``RetryPolicy`` says (none unless given: the commands pass the OpenAI SDK's default), its
backoff stretched by the deployment's dilation.
"""

from __future__ import annotations

from collections.abc import Callable

from testbed.deploy.deployment import Deployment, LoadTarget
from testbed.deploy.run_record import ClientRecord
from testbed.load.client_process import run_client_process
from testbed.load.progress import Progress
from testbed.load.replay_client import ROUTER_GRACE_S, ClientOptions, replay
from testbed.load.retry import NO_RETRY, RetryPolicy
from testbed.traces.workload import RequestSpec


class TraceReplay:
    """Replay ``specs`` open- or closed-loop (sessions), as the specs say."""

    samples_memory = False

    def __init__(self, specs: list[RequestSpec], timeout_s: float = 1800.0, label: str = "replay",
                 show_progress: bool = True, router_grace_s: float = ROUTER_GRACE_S,
                 retry: RetryPolicy = NO_RETRY) -> None:
        self.specs, self.timeout_s, self.label, self.show_progress = specs, timeout_s, label, show_progress
        self.router_grace_s = router_grace_s  # emulated s after the router's "down" to wait for its "ready"
        self.retry = retry

    def drive(self, dep: LoadTarget | Deployment, begin: Callable[[float], None]) -> tuple[list[RequestSpec],
                                                                            dict[str, ClientRecord]]:
        progress = Progress(self.label) if self.show_progress else None
        try:
            opts = ClientOptions(self.timeout_s, self.router_grace_s * dep.dilation, self.retry, dep.dilation)
            if isinstance(dep, Deployment):  # an emulation: the client is a process of its own, without root
                recs = run_client_process(dep, self.specs, opts, progress, begin)
            else:  # the simulator: a coroutine of its virtual-time loop
                recs = dep.run_client(lambda transport: replay(transport, dep.client_broker, dep.topics, self.specs,
                                                               opts, progress, begin))
        finally:
            if progress is not None:
                progress.close()
        return self.specs, recs


def probe_replay(specs: list[RequestSpec], timeout_s: float, label: str) -> TraceReplay:
    """A dilation probe's load (``Replayer``): the requests once, without a progress line."""
    return TraceReplay(specs, timeout_s, label, show_progress=False)
