"""What a scenario emulates: the model (``ModelCard``) and the accelerators (``DeviceProfile``).

A device profile is a roofline with the fractions of it a serving engine actually reaches
(``docs/devices.md``): datasheet peak and bandwidth, a compute and a bandwidth efficiency, a
per-pass overhead and, for a tensor-parallel instance, the latency of an all-reduce and the
interconnect's bandwidth. ``fitted_to`` names the measurements a profile was fitted to;
``testbed profile check`` recomputes them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.worker_config import DeviceSpec, ModelCost


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FitSource(_Strict):
    """Measurements a profile reproduces: a CSV (``testbed profile fit``'s format), relative
    to the scenario's folder, and the model card they were measured with."""

    measurements: str = Field(min_length=1)
    model: str = Field(description="a key of `models`: the model the measurements ran")


class DeviceProfile(_Strict):
    """Roofline model of an accelerator: a pass takes ``overhead + max(FLOPs / (peak x
    compute_efficiency), bytes / (bandwidth x bandwidth_efficiency))`` (a decode pass with
    ``decode_compute_efficiency``), plus two all-reduces per
    layer on an instance of several devices; a prefill runs in chunks of ``prefill_chunk``
    emulated tokens, each one such pass."""

    peak_tflops: float = Field(gt=0, description="dense peak of the emulated dtype, TFLOP/s (datasheet)")
    mem_gbps: float = Field(gt=0, description="memory bandwidth, GB/s (datasheet)")
    step_overhead_ms: float = Field(default=0.0, ge=0, description="per forward pass: launch, scheduling")
    prefill_chunk: int | None = Field(default=None, ge=1, description="chunked prefill, emulated tokens")
    compute_efficiency: float = Field(default=1.0, gt=0, le=1, description="fraction of peak a pass reaches")
    decode_compute_efficiency: float | None = Field(default=None, gt=0, le=1, description=(
        "fraction of peak a decode pass's (skinny) GEMMs reach; null: compute_efficiency"))
    bandwidth_efficiency: float = Field(default=1.0, gt=0, le=1,
                                        description="fraction of memory bandwidth a pass reaches")
    allreduce_us: float = Field(default=0.0, ge=0, description="latency of one tensor-parallel all-reduce")
    link_gbps: float | None = Field(default=None, gt=0, description=(
        "interconnect bandwidth per device for the all-reduce's bytes, GB/s (null: free)"))
    fitted_to: FitSource | None = None

    def spec(self, name: str, devices: int = 1, peak_scale: float = 1.0) -> DeviceSpec:
        """The pacing contract of an instance of ``devices`` of these; ``peak_scale``
        multiplies the peak (another dtype's tensor cores, see ``testbed.profile.fit``)."""
        return DeviceSpec(name=name if devices == 1 else f"{devices}x{name}",
                          peak_tflops=self.peak_tflops * devices * peak_scale, mem_gbps=self.mem_gbps * devices,
                          step_overhead_ms=self.step_overhead_ms, prefill_chunk=self.prefill_chunk,
                          compute_efficiency=self.compute_efficiency,
                          decode_compute_efficiency=self.decode_compute_efficiency,
                          bandwidth_efficiency=self.bandwidth_efficiency,
                          devices=devices, allreduce_us=self.allreduce_us, link_gbps=self.link_gbps)


class ModelCard(_Strict):
    """The model being emulated, from its public configuration (``docs/models.md``).

    Layers are of up to three kinds: full attention (the rest), ``linear_layers`` (linear
    attention: a fixed-size recurrent state per request, ``linear_state_bytes`` each) and
    ``window_layers`` (sliding-window attention over the last ``window`` tokens). A
    full-attention layer caches ``2 x kv_heads x head_dim`` values per token (GQA; a
    ``v_head_dim`` of its own when values are narrower), or ``kv_latent_dim + kv_rope_dim``
    (MLA), in ``kv_dtype_bytes`` (FP8: 1, FP4: 0.5). So KV bytes per token count the full
    layers alone, and a request also carries ``state_bytes``: its linear states and its
    window's KV, whatever its length. A mixture of experts computes with ``active_params``
    and, when ``experts`` and ``experts_per_token`` are given, a pass reads the weights of
    the distinct experts its tokens route to."""

    layers: int = Field(ge=1)
    heads: int = Field(ge=1, description="query heads")
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    params: float = Field(gt=0, description="total parameters")
    active_params: float | None = Field(default=None, gt=0, description="per token (mixture of experts)")
    dtype_bytes: int = Field(default=2, ge=1, le=8, description="of a weight and an activation")
    kv_dtype_bytes: float | None = Field(default=None, ge=0.5, le=8,
                                          description="of a cached KV value; null: dtype_bytes")
    v_head_dim: int | None = Field(default=None, ge=1, description="of a value head when it differs from head_dim")
    kv_latent_dim: int | None = Field(default=None, ge=1, description="MLA: cached latent width per layer")
    kv_rope_dim: int = Field(default=0, ge=0, description="MLA: the decoupled RoPE key cached beside the latent")
    linear_layers: int = Field(default=0, ge=0, description="linear-attention layers (fixed-size state)")
    linear_state_bytes: int = Field(default=0, ge=0, description="one linear layer's state per request, bytes")
    window_layers: int = Field(default=0, ge=0, description="sliding-window attention layers")
    window: int | None = Field(default=None, ge=1, description="tokens a window layer attends to")
    window_kv_heads: int | None = Field(default=None, ge=1, description="KV heads of a window layer; null: kv_heads")
    experts: int | None = Field(default=None, ge=2, description="routed experts per MoE layer")
    experts_per_token: int | None = Field(default=None, ge=1, description="routed experts a token uses")

    @model_validator(mode="after")
    def _consistent(self) -> ModelCard:
        if self.linear_layers + self.window_layers >= self.layers:
            raise ValueError(f"linear_layers + window_layers ({self.linear_layers + self.window_layers}) must leave "
                             f"at least one of the {self.layers} layers to full attention")
        if self.linear_layers and not self.linear_state_bytes:
            raise ValueError("linear_layers needs linear_state_bytes (one layer's state per request)")
        if bool(self.window_layers) != (self.window is not None):
            raise ValueError("window_layers and window go together")
        if (self.experts is None) != (self.experts_per_token is None):
            raise ValueError("experts and experts_per_token go together")
        if self.experts is not None:
            assert self.experts_per_token is not None
            if self.experts_per_token >= self.experts:
                raise ValueError(f"experts_per_token ({self.experts_per_token}) must be below experts ({self.experts})")
            if self.active_params is None or self.active_params >= self.params:
                raise ValueError("a mixture of experts needs active_params below params")
        return self

    @property
    def full_layers(self) -> int:
        return self.layers - self.linear_layers - self.window_layers

    @property
    def kv_bytes(self) -> float:
        """Bytes of a cached value (KV dtype)."""
        return self.kv_dtype_bytes if self.kv_dtype_bytes is not None else self.dtype_bytes

    def _token_values(self, kv_heads: int) -> int:
        """Cached values per token in one attention layer with ``kv_heads`` heads."""
        if self.kv_latent_dim is not None:
            return self.kv_latent_dim + self.kv_rope_dim
        return kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV that grows with the context: the full-attention layers'."""
        return round(self.full_layers * self._token_values(self.kv_heads) * self.kv_bytes)

    @property
    def state_bytes(self) -> int:
        """What a request carries whatever its length: linear states and the window's KV (a
        prompt at least as long as the window)."""
        window = 0.0
        if self.window is not None:
            window = self.window_layers * self.window * self._token_values(self.window_kv_heads or self.kv_heads)
        return round(self.linear_layers * self.linear_state_bytes + window * self.kv_bytes)

    def kv_bytes_for(self, tokens: int) -> int:
        """A request's KV after ``tokens`` tokens: what a prefill of them ships."""
        return self.kv_bytes_per_token * tokens + self.state_bytes

    @property
    def compute_params(self) -> float:
        """Parameters a token passes through (all of them unless it is a mixture of experts)."""
        return self.active_params or self.params

    @property
    def expert_params(self) -> float:
        """One routed expert's parameters across every MoE layer: ``(params - active) /
        (experts - experts_per_token)`` (0 unless the card gives its experts)."""
        if self.experts is None or self.experts_per_token is None or self.active_params is None:
            return 0.0
        return (self.params - self.active_params) / (self.experts - self.experts_per_token)

    def cost(self, dtype_bytes: int | None = None) -> ModelCost:
        """What a forward pass costs (weights and KV in ``dtype_bytes``, default the card's)."""
        card = self if dtype_bytes is None else self.model_copy(update={"dtype_bytes": dtype_bytes})
        # Attention FLOPs per context token: QK over query/key heads, PV over value heads.
        hidden = card.heads * (card.head_dim + (card.v_head_dim or card.head_dim)) // 2
        # A linear layer's state update and read: ~4 FLOPs per state value and token.
        state_values = card.linear_state_bytes / card.kv_bytes
        return ModelCost(params=card.compute_params, layers=card.layers, hidden=hidden,
                         kv_bytes_per_token=card.kv_bytes_per_token,
                         weight_bytes=card.compute_params * card.dtype_bytes, dtype_bytes=card.dtype_bytes,
                         attention_layers=card.full_layers if card.full_layers != card.layers else None,
                         window_layers=card.window_layers, window=card.window or 0,
                         linear_flops_per_token=4 * card.linear_layers * state_values,
                         state_bytes=card.state_bytes, linear_layers=card.linear_layers,
                         experts=card.experts or 0,
                         experts_per_token=card.experts_per_token or 0,
                         expert_weight_bytes=card.expert_params * card.dtype_bytes)
