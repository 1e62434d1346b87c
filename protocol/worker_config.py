"""What crosses between the orchestrator and a worker process, besides MQTT messages.

* ``WorkerConfig``: the worker's whole configuration, built from the scenario in one place
  (``testbed.deploy.cluster``), written as JSON next to the run and validated by the worker at
  start (``python -m workers CONFIG.json``). It embeds one ``BrokerInfo``, one
  ``DeviceSpec`` and the test-only ``WorkerFaults``.
* ``WorkerStats``: the statistics file a worker rewrites every second and on exit, read by
  the orchestrator for ``summary.json`` and the plots.

Both are strict (unknown fields are errors), so a renamed field fails loudly at the
boundary instead of silently reading a default. The MQTT messages live in
``protocol.messages``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# When a prefill's KV leaves for its decoders: once the whole prefill is done (the naive
# baseline), frame by frame as each prefill pass (chunk) that computed it ends, or layer group
# by layer group as the pass computes them, so that the transfer overlaps the compute
# (``workers/kv_stream.py``).
KvTransfer = Literal["after-prefill", "per-chunk", "per-layer"]
STREAMED: tuple[KvTransfer, ...] = ("per-chunk", "per-layer")  # the modes that stream as computed
MAX_LAYER_GROUPS = 64  # a per-layer transfer's layer groups (each frame one group's KV)
MAX_KV_CONNECTIONS = 16  # TCP connections one KV transfer may use (``workers/kv_stripes.py``)

WorkerRole = Literal["prefill", "decode", "relay-decode", "colocated"]
PREFILL_ROLES: tuple[WorkerRole, ...] = ("prefill", "colocated")  # roles that prefill: their caches are a prefill's


# Every worker's KV listener (its host is its own namespace); the delay line counts KV bytes by it.
KV_PORT = 7070

class Contract(BaseModel):
    """Base of every cross-process shape: strict, immutable, JSON in and out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def dump(self) -> bytes:
        return self.model_dump_json().encode()


class BrokerInfo(Contract):
    """Where the run's mosquitto listens and the run's credentials."""

    host: str
    port: int = Field(ge=1, le=65535)
    username: str
    password: str


class DeviceSpec(Contract):
    """The roofline a worker's steps are paced to (``workers.device``); no peak = native.
    Peak and bandwidth are the instance's (``devices`` accelerators); the efficiencies are the
    fractions of them a serving engine reaches; a tensor-parallel instance pays two
    all-reduces per layer and pass (latency plus the activations over the link)."""

    name: str = "native"
    peak_tflops: float | None = Field(default=None, gt=0)
    mem_gbps: float | None = Field(default=None, gt=0)
    step_overhead_ms: float = Field(default=0.0, ge=0)
    prefill_chunk: int | None = Field(default=None, ge=1)  # emulated tokens per prefill pass
    compute_efficiency: float = Field(default=1.0, gt=0, le=1)
    decode_compute_efficiency: float | None = Field(default=None, gt=0, le=1)  # None: compute_efficiency
    bandwidth_efficiency: float = Field(default=1.0, gt=0, le=1)
    devices: int = Field(default=1, ge=1)
    allreduce_us: float = Field(default=0.0, ge=0)
    link_gbps: float | None = Field(default=None, gt=0)  # per accelerator; None: the bytes cost nothing


class ModelCost(Contract):
    """What a forward pass of the priced model costs: parameters a token passes through,
    layers, attention width (query heads x head dim), KV bytes per token, weight bytes a
    pass reads. A hybrid model's layers of other kinds (``testbed.hardware.ModelCard``)
    and a mixture of experts' weights add what their defaults leave out: a dense model's
    cost is the first six fields alone."""

    params: float = Field(gt=0)
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)  # of the full-attention layers: the KV that grows with the context
    weight_bytes: float = Field(gt=0)  # what one token's pass reads (its active experts)
    dtype_bytes: int = Field(default=2, ge=1)  # of an activation value (what an all-reduce moves)
    attention_layers: int | None = Field(default=None, ge=1)  # full attention (quadratic); None: every layer
    window_layers: int = Field(default=0, ge=0)  # sliding-window attention over the last ``window`` tokens
    window: int = Field(default=0, ge=0)
    linear_flops_per_token: float = Field(default=0.0, ge=0)  # linear-attention layers' state updates
    state_bytes: float = Field(default=0.0, ge=0)  # per request, fixed size: linear states and window KV
    linear_layers: int = Field(default=0, ge=0)  # their states serve a cached prefix only where kept
    experts: int = Field(default=0, ge=0)  # routed experts per MoE layer (0: not a mixture)
    experts_per_token: int = Field(default=0, ge=0)
    expert_weight_bytes: float = Field(default=0.0, ge=0)  # one routed expert across every MoE layer

    def pass_weight_bytes(self, rows: int) -> float:
        """Weight bytes a pass over ``rows`` tokens reads: a mixture reads each expert its
        tokens route to once, ``E x (1 - (1 - k/E)^rows)`` of them if routing is uniform
        (``weight_bytes`` already holds one token's ``k``)."""
        if not self.experts:
            return self.weight_bytes
        e, k = self.experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** rows)
        return self.weight_bytes + (touched - k) * self.expert_weight_bytes

    def attention_flops(self, rows: int, context: float) -> float:
        """Attention FLOPs of ``rows`` tokens whose mean context is ``context`` (beyond the
        weight GEMMs): full layers over the whole context, window layers over at most their
        window, linear layers a fixed cost per token."""
        flops = 4 * (self.attention_layers or self.layers) * self.hidden * rows * context
        if self.window_layers:
            flops += 4 * self.window_layers * self.hidden * rows * min(context, self.window)
        if self.linear_flops_per_token:
            flops += self.linear_flops_per_token * rows
        return flops


class Scales(Contract):
    """``docs/emulated-time.md``: one replayed input (output) token stands for ``s_in``
    (``s_out``) emulated tokens; real seconds = ``dilation`` x emulated seconds."""

    s_in: int = Field(default=1, ge=1)
    s_out: int = Field(default=1, ge=1)
    dilation: float = Field(default=1.0, gt=0)


class WorkerFaults(Contract):
    """Fault injection for tests: die abruptly after N streamed tokens; corrupt KV block N."""

    die_after_tokens: int | None = Field(default=None, ge=1)
    corrupt_block: int | None = Field(default=None, ge=0)


class RunAs(Contract):
    """The unprivileged account a worker or the router becomes once it is set up
    (``workers.privilege``)."""

    uid: int = Field(ge=0)
    gid: int = Field(ge=0)


class WorkerConfig(Contract):
    name: str
    role: WorkerRole
    run_id: str
    host_ip: str
    kv_port: int = Field(default=KV_PORT, ge=1, le=65535)
    # The namespace of this worker's host when its process stands for several hosts (modeled
    # instances sharing a process): its KV sockets are opened there. None: the process's own.
    netns: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    broker: BrokerInfo
    kv_token: str = ""  # per-run secret a KV sender puts in HELLO; receivers refuse others ("": no check)
    model_path: str
    # real: the small model computes every token; modeled: no forward pass (workers/modeled.py)
    compute: Literal["real", "modeled"] = "real"
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    threads: int = Field(default=1, ge=1)
    block_size: int = Field(default=16, ge=1)
    prefill_chunk: int = Field(default=512, ge=1)
    cache_tokens: int = Field(default=262144, ge=0)
    max_batch: int = Field(default=32, ge=1)
    kv_capacity_tokens: int | None = Field(default=None, ge=1)  # decoders: KV of admitted requests (replayed tokens)
    kv_timeout_s: float = Field(default=120.0, gt=0)
    kv_read_timeout_s: float = Field(default=60.0, gt=0)  # a KV peer silent this long broke the transfer
    kv_hello_wait_s: float = Field(default=2.0, gt=0)  # a HELLO's wait for its request's command
    kv_streams_per_peer: int = Field(default=1, ge=1)
    kv_transfer: KvTransfer = "after-prefill"  # a prefill command may choose another (``PrefillCmd``)
    kv_connections: int = Field(default=1, ge=1, le=MAX_KV_CONNECTIONS)  # TCP connections per transfer (too)
    kv_layer_groups: int = Field(default=4, ge=1, le=MAX_LAYER_GROUPS)  # per-layer: a frame carries one group's KV
    # Emulated tokens a prefill pass packs from several waiting requests (each at most the
    # device's prefill_chunk of its own); None: one request at a time (``workers/prefill.py``).
    prefill_token_budget: int | None = Field(default=None, ge=1)
    # Wire bytes of a request's fixed-size state (a hybrid card's linear states and window KV,
    # scaled like its KV) that every transfer carries after the KV; 0: a model without.
    kv_state_bytes: int = Field(default=0, ge=0, le=1 << 30)
    device: DeviceSpec = DeviceSpec()
    cost: ModelCost | None = None  # the emulated model; None: price the real model's own work
    scales: Scales = Scales()
    stats_path: str = ""  # in a folder ``run_as`` owns: written after privileges are dropped
    run_as: RunAs | None = None  # None: keep the privileges it started with
    faults: WorkerFaults = WorkerFaults()


# ------------------------------------------------------------------------- statistics file
class WorstOverrun(Contract):
    kind: str
    real_s: float
    modeled_s: float
    t: float  # unix time the step ended
    detail: str = ""  # e.g. a decode step's batch size and whether the batch was rebuilt


# A paced step that ends later than this share of its modeled time after its modeled end,
# and later than LATE_WAKE_FLOOR_S, counts against the fidelity verdict as an overrun does.
# The floor is the bound the delay line's frames are held to (P99 lateness 1 ms): on a
# virtual machine a process that sleeps wakes up to 2-5 ms late now and then however idle
# the host (docs/emulated-time.md), which says nothing about whether the emulation keeps up.
LATE_WAKE = 0.05
LATE_WAKE_FLOOR_S = 0.001
# A step's need (``DeviceReport.needs``) counted in buckets of 5 %: bucket k holds needs up to
# NEED_STEP ** k; needs under a tenth of the modeled time share the lowest bucket.
NEED_STEP = 1.05
NEED_MIN_BUCKET = -48


class DeviceReport(Contract):
    """Pacing totals (real seconds): steps, how many overran their modeled time and by how
    much; per kind of step (prefill, decode, extend) the same counts."""

    device: str
    native: bool = True  # host CPU, not an emulated device: nothing is paced
    steps: int = 0
    overruns: int = 0
    overrun_s: float = 0.0
    modeled_s: float = 0.0
    real_s: float = 0.0
    late_wakes: int = 0  # steps whose work fit but whose end came late (workers/device.py)
    late_s: float = 0.0
    late_max_s: float = 0.0
    by_kind: dict[str, tuple[int, int]] = {}  # kind -> (steps, overruns)
    worst: list[WorstOverrun] = []  # the largest overruns, largest first
    # Paced steps by need, bucket -> steps: how many times its modeled time a step would have
    # needed to neither overrun nor end late (``workers.device.need_bucket``); from it the verdict
    # says how far down the dilation could have gone (``testbed.deploy.fidelity.needed_dilation``).
    needs: dict[int, int] = {}

    @property
    def overrun_fraction(self) -> float:
        return self.overruns / self.steps if self.steps else 0.0


class CacheReport(Contract):
    """Prefix-cache counters and their history: (unix time, hit tokens, looked-up tokens)."""

    hit_rate: float
    blocks: int
    hit_tokens: int
    lookup_tokens: int
    evicted_blocks: int = 0
    # A hybrid model's cache: matched KV past the last kept recurrent state, recomputed (not a hit).
    state_miss_tokens: int = 0
    series: list[tuple[float, int, int]] = []


class TransferTotals(Contract):
    count: int = 0
    bytes: int = 0
    cancelled: int = 0


class PrefillCounters(Contract):
    computed_tokens: int = 0
    reused_tokens: int = 0
    warmed_tokens: int = 0  # answers' tokens computed after their request, off its critical path
    warm_skipped: int = 0  # warm commands whose prompt was no longer cached (nothing computed)
    transfers: TransferTotals = TransferTotals()
    # Passes packing several requests (prefill_token_budget): how many, and the emulated tokens
    # they computed (over passes x budget: how full the passes ran).
    packed_passes: int = 0
    packed_tokens: int = 0


class DecodeCounters(Contract):
    step_ms_by_batch: dict[int, float] = {}  # mean real step time by batch size (recent steps)
    tokens_out: int = 0
    batch_builds: int = 0
    handoffs_sent: int = 0
    extends_done: int = 0
    extend_mismatches: int = 0
    admission_waits: int = 0  # requests whose KV arrived when the decoder had no room
    admission_wait_max_s: float = 0.0  # the longest of those waits (real seconds)
    admission_queue_max: int = 0


class MemoryReport(Contract):
    """The worker process's resident memory, the KV it holds (caches, sequences, batches),
    what trimming the allocator gave back, and per minute the lowest RSS net of that KV
    (``workers.allocator``)."""

    pid: int = Field(ge=1)
    rss_bytes: int = Field(ge=0)
    held_bytes: int = Field(default=0, ge=0)  # KV in caches, sequences and batches
    trims: int = Field(default=0, ge=0)
    trim_s: float = Field(default=0.0, ge=0)
    released_bytes: int = Field(default=0, ge=0)
    floor: list[tuple[float, int]] = Field(default=[], max_length=1440)  # (minute's unix start, bytes)


class WorkerStats(Contract):
    worker: str
    role: WorkerRole
    compute: Literal["real", "modeled"] = "real"
    device: DeviceReport
    cache: CacheReport | None = None
    repeated_commands: int = 0  # start commands delivered again (QoS 1) and dropped
    memory: MemoryReport | None = None
    prefill: PrefillCounters | None = None
    decode: DecodeCounters | None = None
