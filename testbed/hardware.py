"""What a scenario emulates: the model (``ModelCard``) and the accelerators (``DeviceProfile``).

A device profile is a roofline with the fractions of it a serving engine actually reaches
(``docs/devices.md``): datasheet peak and bandwidth, a compute and a bandwidth efficiency, a
per-pass overhead and, for a tensor-parallel instance, the latency of an all-reduce and the
interconnect's bandwidth. ``fitted_to`` names the measurements a profile was fitted to;
``testbed profile check`` recomputes them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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
    """The model being emulated, from its public configuration. KV bytes per token follow
    (``2 x layers x kv_heads x head_dim x dtype_bytes``, or ``layers x kv_latent_dim x
    dtype_bytes`` for MLA), and so do the weight bytes a decode step reads."""

    layers: int = Field(ge=1)
    heads: int = Field(ge=1, description="query heads")
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    params: float = Field(gt=0, description="total parameters")
    active_params: float | None = Field(default=None, gt=0, description="per token (mixture of experts)")
    dtype_bytes: int = Field(default=2, ge=1, le=8)
    kv_latent_dim: int | None = Field(default=None, ge=1, description="MLA: cached latent width per layer")

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_latent_dim is not None:
            return self.layers * self.kv_latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def compute_params(self) -> float:
        """Parameters a token passes through (all of them unless it is a mixture of experts)."""
        return self.active_params or self.params

    def cost(self, dtype_bytes: int | None = None) -> ModelCost:
        """What a forward pass costs (weights and KV in ``dtype_bytes``, default the card's)."""
        card = self if dtype_bytes is None else self.model_copy(update={"dtype_bytes": dtype_bytes})
        return ModelCost(params=card.compute_params, layers=card.layers, hidden=card.heads * card.head_dim,
                         kv_bytes_per_token=card.kv_bytes_per_token,
                         weight_bytes=card.compute_params * card.dtype_bytes, dtype_bytes=card.dtype_bytes)
