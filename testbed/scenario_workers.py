"""A scenario's ``workers:`` section: how every worker runs (model, caches, batching, the KV
transport's limits and timeouts, failure detection, the accounts components become), and
the strict base every part of a scenario is validated with (``testbed.scenario``)."""

from __future__ import annotations

import pwd
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.worker_config import MAX_KV_CONNECTIONS, MAX_LAYER_GROUPS, KvTransfer


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # .inf, .nan: a mistake


class WorkerSettings(Strict):
    model: Path | None = Field(default=None, description="local causal-LM directory; null = default model")
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    threads: int = Field(default=1, ge=1, le=64)
    block_size: int = Field(default=16, ge=1, le=4096)
    prefill_chunk: int = Field(default=512, ge=1)
    # Prefix caches' capacity, in emulated tokens when emulating (the replayed model's caches
    # hold this divided by the token scale, as decode_kv_tokens): the same share of a trace's
    # contexts at every scale. 4,194,304 = 262,144 replayed tokens at the default scale 16.
    prefill_cache_tokens: int = Field(default=4_194_304, ge=0, description=(
        "a prefill instance's prefix cache (emulated tokens when emulating)"))
    decode_cache_tokens: int = Field(default=4_194_304, ge=0, description=(
        "a decoder's radix cache, DRC (emulated tokens when emulating)"))
    max_batch: int = Field(default=32, ge=1)
    decode_kv_tokens: int | None = Field(default=None, ge=1, description=(
        "KV a decoder holds for the requests it decodes (prompt + output tokens each; emulated tokens "
        "when emulating): a request whose KV arrived waits for room, its first token unsent; null: "
        "bounded by max_batch only"))
    kv_timeout_s: float = Field(default=120.0, gt=0)
    kv_read_timeout_s: float = Field(default=60.0, gt=0, description=(
        "a KV transfer whose peer sends, takes or acknowledges nothing for this long is broken (its reads and "
        "writes time out, TCP gives up on unacknowledged data, keepalive probes idle connections)"))
    kv_hello_wait_s: float = Field(default=2.0, gt=0, description=(
        "how long a decoder holds a KV HELLO whose request's command has not arrived (the two take different "
        "paths); then the transfer is refused"))
    kv_streams_per_peer: int = Field(
        default=1, ge=1, le=64,
        description="KV transfers a sender runs at once to one receiver; later ones wait their turn in "
                    "arrival order (a transfer engine's queue per peer)")
    kv_transfer: KvTransfer = Field(default="after-prefill", description=(
        "when a prefill's KV leaves: after-prefill (all at its end), per-chunk (each pass's KV as the pass ends) "
        "or per-layer (each pass's KV in layer groups as the pass computes them: kv_layer_groups)"))
    kv_layer_groups: int = Field(default=4, ge=1, le=MAX_LAYER_GROUPS, description=(
        "per-layer transfers: the model's layers in this many groups; group g of G is computed (g+1)/G of the "
        "way through a pass (each layer an equal share of it) and leaves then, the last when the pass ends"))
    kv_connections: int = Field(default=1, ge=1, le=MAX_KV_CONNECTIONS, description=(
        "TCP connections one KV transfer uses at most, frames spread over them in turn (parallel streams "
        "sharing the line, as transfer engines open on commodity Ethernet: each connection is a flow of its own "
        "at the bottleneck, so a transfer over k takes up to k shares of a contended line); a policy may ask "
        "for another number per request (its ``connections`` option)"))
    prefill_token_budget: int | None = Field(default=None, ge=1, description=(
        "emulated tokens one prefill pass packs from several waiting requests, first come first served, each "
        "taking at most its device's prefill_chunk (a request's last chunk is its tail, sharing the pass with "
        "the next one's head), priced as one pass; null: one request at a time. SGLang's chunked_prefill_size and "
        "vLLM's max_num_batched_tokens: 8,192 on this class of GPU"))
    request_timeout_s: float = Field(default=600.0, gt=0)
    unreachable_grace_s: float = Field(default=30.0, ge=0, description=(
        "a worker whose broker session lapsed while the router cannot reach it (a WAN outage) keeps its "
        "requests this long; they resume when it is back, and only then is it dead. A worker whose host "
        "refuses the router's probe (the process is gone) is dead at once"))
    failure_detection: Literal["probe", "none"] = Field(default="probe", description=(
        "probe: a worker's last will is confirmed by probing its host and a dead worker's requests end at once "
        "(unreachable ones wait unreachable_grace_s); none: the router ignores wills, as one without health "
        "checks, and requests end only by their own timeouts (the PD-outage baseline, docs/faults.md)"))
    run_as: str = Field(default="per-component", pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description=(
        "who the router, the workers and serve's front end become once set up (they parse what arrives from "
        "the network): per-component, a uid of its own each (router, each worker role, front end; "
        "docs/workers.md, trust boundaries); an account's name, that account for all; root, they keep "
        "root's privileges"))
    cache_outputs: bool = Field(default=False, description=(
        "after a request completes, the prefill instance that served it computes the KV of its answer when "
        "no prefill waits, so the session's next turn finds the whole conversation cached (docs/scenarios.md)"))
    modeled_per_process: int = Field(
        default=4, ge=1, le=256,
        description="modeled instances of one datacenter and role that share one worker process (each "
                    "keeps its own address, links, broker session, queue, cache and pacer); 1: a process "
                    "each. Real compute always runs one per process. One event loop serves its instances "
                    "one callback at a time: 8 busy decoders in one ended steps late at D 0.5 where 4 did not")

    @field_validator("run_as")
    @classmethod
    def _account(cls, v: str) -> str:
        if v == "per-component":
            return v
        try:
            pwd.getpwnam(v)
        except KeyError:
            raise ValueError(f"no account {v!r} on this machine (root keeps root's privileges)") from None
        return v
