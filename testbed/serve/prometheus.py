"""``GET /metrics``: the served emulation in Prometheus text format.

Latencies are in emulated seconds, as everywhere in the testbed (TTFT, end to end; TPOT
per emulated token), with the dilation and token scale exported beside them so a scraper
can convert: real seconds = emulated seconds x dilation. Counted as requests end:
requests by outcome, prompt and generated tokens (replayed tokens, as the client sent and
received them), requests by pipeline (named as the router names them, from the workers
that streamed them). Read
from the run's files at each scrape: every worker's paced steps and overruns (the
fidelity counters), KV bytes the prefills sent, and the WAN delay line's frames, bytes,
drops by cause and late frames per direction.

``prometheus_client`` writes the exposition format (escaping, histogram buckets,
``_created`` samples), which clients such as Prometheus and aiperf parse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.worker_config import Scales, WorkerStats
from testbed.deploy.run_record import ClientRecord
from testbed.net.delayline_contract import DelayLineReport

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, float("inf"))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Pipelines:
    """Names a request's pipeline as the router does, from the workers that streamed it."""

    roles: dict[str, str]  # worker -> role
    dcs: dict[str, str]  # worker -> datacenter
    relaying: bool  # the policy plans relays (PDD): a lone main decoder is P-MD

    def of(self, rec: ClientRecord) -> str:
        streamed = [self.roles.get(w, w) for w in rec.workers]
        if "relay-decode" in streamed:
            return "P-RLD-MD" if "decode" in streamed else "P-RLD"
        if not rec.workers:
            return "none"
        return "P-MD" if self.relaying else f"P-D({self.dcs.get(rec.workers[0], '?')})"


class _RunFiles(Collector):
    """Counters read from the run's statistics files at each scrape."""

    def __init__(self, workers: Callable[[], dict[str, WorkerStats]],
                 delayline: Callable[[], DelayLineReport | None]) -> None:
        self.workers, self.delayline = workers, delayline

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        steps = CounterMetricFamily("testbed_worker_steps", "Paced steps (prefill, decode, extend)", labels=["worker"])
        over = CounterMetricFamily("testbed_worker_overruns", "Steps whose real compute overran the modeled time",
                                   labels=["worker"])
        over_s = CounterMetricFamily("testbed_worker_overrun_seconds", "Real seconds past the modeled time",
                                     labels=["worker"])
        kv = CounterMetricFamily("testbed_kv_sent_bytes", "KV bytes a prefill worker sent to decoders",
                                 labels=["worker"])
        for name, w in sorted(self.workers().items()):
            steps.add_metric([name], w.device.steps)
            over.add_metric([name], w.device.overruns)
            over_s.add_metric([name], w.device.overrun_s)
            if w.prefill is not None:
                kv.add_metric([name], w.prefill.transfers.bytes)
        yield from (steps, over, over_s, kv)
        report = self.delayline()
        if report is None:
            return
        wan_bytes = CounterMetricFamily("testbed_wan_bytes", "Bytes the WAN delay line delivered",
                                        labels=["direction"])
        frames = CounterMetricFamily("testbed_wan_frames", "Frames the WAN delay line delivered", labels=["direction"])
        drops = CounterMetricFamily("testbed_wan_drops", "Frames the WAN delay line dropped",
                                    labels=["direction", "cause"])
        late = CounterMetricFamily("testbed_wan_late_frames", "Frames delivered more than 1 ms (real) late",
                                   labels=["direction"])
        p99 = GaugeMetricFamily("testbed_wan_lateness_p99_seconds", "Delay-line lateness P99 (real seconds)",
                                labels=["direction"])
        for name, d in sorted(report.directions.items()):
            wan_bytes.add_metric([name], d.bytes_out)
            frames.add_metric([name], d.frames_out)
            for cause in ("loss", "queue_full", "overflow", "error", "fault"):
                drops.add_metric([name, cause], getattr(d, f"drop_{cause}"))
            late.add_metric([name], d.late_over_1ms)
            p99.add_metric([name], d.late_p99_us / 1e6)
        yield from (wan_bytes, frames, drops, late, p99)


class ServeMetrics:
    def __init__(self, scales: Scales, pipelines: Pipelines, workers: Callable[[], dict[str, WorkerStats]],
                 delayline: Callable[[], DelayLineReport | None]) -> None:
        self.scales, self.pipelines_of = scales, pipelines
        r = self.registry = CollectorRegistry()
        self.requests = Counter("testbed_requests", "Requests that ended, by outcome", ["outcome"], registry=r)
        self.running = Gauge("testbed_requests_running", "Requests being served", registry=r)
        self.prompt_tokens = Counter("testbed_prompt_tokens", "Prompt tokens received (replayed tokens)", registry=r)
        self.generation_tokens = Counter("testbed_generation_tokens", "Tokens generated (replayed tokens)",
                                         registry=r)
        self.pipelines = Counter("testbed_pipeline_requests", "Completed requests by pipeline", ["pipeline"],
                                 registry=r)
        self.ttft = Histogram("testbed_time_to_first_token_seconds", "TTFT, emulated seconds",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("testbed_e2e_request_latency_seconds", "End-to-end latency, emulated seconds",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("testbed_time_per_output_token_seconds", "TPOT per emulated token, emulated seconds",
                              buckets=TPOT_BUCKETS, registry=r)
        Gauge("testbed_time_dilation", "Real seconds per emulated second", registry=r).set(scales.dilation)
        Gauge("testbed_token_scale", "Emulated output tokens per replayed token", registry=r).set(scales.s_out)
        r.register(_RunFiles(workers, delayline))

    def ended(self, rec: ClientRecord) -> None:
        """Count a request that ended (completed or failed)."""
        self.requests.labels("completed" if rec.ok else "failed").inc()
        self.prompt_tokens.inc(rec.prompt_len)
        self.generation_tokens.inc(len(rec.tokens))
        if not rec.ok or not rec.token_times:
            return
        self.pipelines.labels(self.pipelines_of.of(rec)).inc()
        d = self.scales.dilation
        self.ttft.observe((rec.token_times[0] - rec.sent) / d)
        self.e2e.observe((rec.token_times[-1] - rec.sent) / d)
        if len(rec.token_times) > 1:
            per_token = (rec.token_times[-1] - rec.token_times[0]) / (len(rec.token_times) - 1)
            self.tpot.observe(per_token / (d * self.scales.s_out))

    def render(self) -> bytes:
        return generate_latest(self.registry)
