"""Measure a dense decoder's step times on a GPU: the CSV ``testbed profile fit`` reads.

Run it as a script on a machine with a CUDA GPU and PyTorch (nothing else of this project
is imported, so it runs where only PyTorch is installed)::

    python testbed/profile/step_times.py --out h200-qwen2.5-7b.csv

The model is built from its shape with random bf16 weights (no download: step times depend on
the shapes, not the values): by default Qwen2.5-7B's (28 layers, width 3584, 28 query and 4
KV heads of 128, MLP 18944, vocabulary 152064). One forward pass is what a serving engine
runs: RMSNorm, fused QKV with RoPE, attention through PyTorch's fused kernels (FlashAttention
or cuDNN; grouped KV heads native, never copied), SwiGLU MLP, logits for the last position of
each sequence only, the KV written into a preallocated cache. Every pass is captured once in
a CUDA graph and replayed (engines graph their decode steps), so the launches of this
script's Python loop over layers (~30 ms a pass, measured) are not timed as the GPU's work.

Rows: ``prefill`` at batch 1 (``tokens`` new after ``context`` cached: a first chunk, and a
chunk after a long cached prefix) and ``decode`` (one step of ``batch`` requests at
``context``), each the median of several timed repeats after warm-ups (CUDA events).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
PREFILLS = ((128, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0),
            (512, 8192), (2048, 16384), (8192, 8192), (8192, 32768))  # fmt: skip
DECODES = ((1, 1024), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (32, 8192),
           (128, 1024), (128, 4096), (256, 1024))  # fmt: skip


@dataclass(frozen=True)
class Shape:
    layers: int = 28
    hidden: int = 3584
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    mlp: int = 18944
    vocab: int = 152064
    rope_theta: float = 1e6

    @property
    def params(self) -> int:
        qkvo = self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = self.hidden * qkvo + self.head_dim * (self.heads + 2 * self.kv_heads) + 3 * self.hidden * self.mlp
        return self.layers * (layer + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden


class Model:
    """Random weights of ``shape`` on the GPU; ``forward`` runs one pass over new tokens."""

    def __init__(self, s: Shape, dev: torch.device) -> None:
        self.s = s
        bf = torch.bfloat16

        def w(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=dev, dtype=bf) * 0.02

        q_out = s.head_dim * (s.heads + 2 * s.kv_heads)
        self.embed = w(s.vocab, s.hidden)
        self.layers = [dict(n1=torch.ones(s.hidden, device=dev, dtype=bf), qkv=w(q_out, s.hidden),
                            qkv_b=w(q_out), o=w(s.hidden, s.heads * s.head_dim),
                            n2=torch.ones(s.hidden, device=dev, dtype=bf), up=w(2 * s.mlp, s.hidden),
                            down=w(s.hidden, s.mlp)) for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=dev, dtype=bf)
        self.head = w(s.vocab, s.hidden)
        self.copy_kv = False  # set when no fused kernel takes grouped KV heads (said in the CSV)
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=dev).float() / s.head_dim))

    def cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.s
        return [(torch.zeros(batch, s.kv_heads, length, s.head_dim, device=self.embed.device, dtype=torch.bfloat16),
                 torch.zeros(batch, s.kv_heads, length, s.head_dim, device=self.embed.device, dtype=torch.bfloat16))
                for _ in range(s.layers)]

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = pos.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([f.cos(), f.cos()], -1).to(x.dtype), torch.cat([f.sin(), f.sin()], -1).to(x.dtype)
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * w

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """A chunk's attention: to the cached prefix in full and to itself causally, two fused
        calls whose outputs are summed rather than merged by their softmax normalisers (random
        weights: the values do not matter, the work is the same)."""
        o = F.scaled_dot_product_attention(q, self._heads(k[:, :, start:end]), self._heads(v[:, :, start:end]),
                                           is_causal=True, enable_gqa=not self.copy_kv)
        if start:
            o = o + F.scaled_dot_product_attention(q, self._heads(k[:, :, :start]), self._heads(v[:, :, :start]),
                                                   enable_gqa=not self.copy_kv)
        return o

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """KV heads as they are, or repeated per query head where no fused kernel takes them grouped."""
        return x.repeat_interleave(self.s.heads // self.s.kv_heads, 1) if self.copy_kv else x

    def forward(self, ids: torch.Tensor, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``ids`` [batch, n] new tokens at positions ``start``..; returns last-position logits."""
        s = self.s
        b, n = ids.shape
        end = start + n
        pos = torch.arange(start, end, device=ids.device)
        x = self.embed[ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            h = self._rms(x, layer["n1"])
            qkv = F.linear(h, layer["qkv"], layer["qkv_b"])
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            q = self._rope(q.view(b, n, s.heads, s.head_dim).transpose(1, 2), pos)
            k = self._rope(k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2), pos)
            k_cache[:, :, start:end] = k
            v_cache[:, :, start:end] = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
            if n == 1:  # decode: each KV head's query heads as a group of queries, no mask
                g = s.heads // s.kv_heads
                o = F.scaled_dot_product_attention(q.reshape(b, s.kv_heads, g, s.head_dim), keys, values)
            else:
                o = self._attend(q, k_cache, v_cache, start, end)
            x = x + F.linear(o.reshape(b, s.heads, n, s.head_dim).transpose(1, 2).reshape(b, n, -1), layer["o"])
            gate, up = F.linear(self._rms(x, layer["n2"]), layer["up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(self._rms(x[:, -1], self.norm), self.head)


def timed(fn, warm: int, reps: int) -> float:  # noqa: ANN001 - a zero-argument callable
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warm`` (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph and replayed, as engines run their steps, so the
    launches of a Python loop over layers are not timed as the GPU's work; as is on a CPU."""
    if not torch.cuda.is_available():
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream before the capture, as PyTorch asks
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_step(model: Model, batch: int, context: int) -> Callable[[], object]:
    """One decode step of ``batch`` requests at ``context``."""
    kv = model.cache(batch, context + 1)
    ids = torch.randint(0, model.s.vocab, (batch, 1), device=model.embed.device)
    return graphed(lambda: model.forward(ids, context, kv))


def measure(model: Model, prefills: Sequence[tuple[int, int]], decodes: Sequence[tuple[int, int]], reps: int,
            env: str) -> list[tuple]:
    rows: list[tuple] = []
    kv = model.cache(1, max(n + c for n, c in prefills))
    for n, c in prefills:
        ids = torch.randint(0, model.s.vocab, (1, n), device=model.embed.device)

        def run(ids: torch.Tensor = ids, c: int = c, kv: list = kv) -> object:
            return model.forward(ids, c, kv)

        try:
            ms = timed(graphed(run), 2, reps)
        except RuntimeError as e:  # no fused kernel takes grouped KV heads here: repeat them
            if model.copy_kv or "kernel" not in str(e).lower():
                raise
            print(f"grouped KV heads refused ({str(e).splitlines()[0][:120]}): repeating them", flush=True)
            model.copy_kv = True
            ms = timed(graphed(run), 2, reps)
        how = "; KV heads repeated per query head" if model.copy_kv else ""
        how += "; one pass in a CUDA graph" if torch.cuda.is_available() else ""
        rows.append(("prefill", n, c, 1, 1, round(ms, 3), 2, f"{env}{how}; median of {reps}"))
        print(f"prefill {n:>6} after {c:>6}: {ms:8.2f} ms", flush=True)
    del kv
    graph_reps = max(reps, 20)
    for batch, c in decodes:
        ms = timed(decode_step(model, batch, c), 3, graph_reps)
        how = "one step in a CUDA graph" if torch.cuda.is_available() else "one step"
        rows.append(("decode", 1, c, batch, 1, round(ms, 3), 2, f"{env}; {how}, median of {graph_reps}"))
        print(f"decode batch {batch:>4} at {c:>6}: {ms:8.2f} ms", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV to write (testbed profile fit's format)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cpu-check", action="store_true",
                   help="no GPU: a two-layer miniature on the CPU, to check the script and its CSV (times meaningless)")
    args = p.parse_args(argv)
    if args.cpu_check:
        shape = Shape(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32, mlp=512, vocab=1000)
        dev = torch.device("cpu")
        prefills, decodes = ((16, 0), (8, 16)), ((1, 16), (4, 8))
    elif not torch.cuda.is_available():
        print("step_times: no CUDA GPU visible (--cpu-check runs a miniature on the CPU)", file=sys.stderr)
        return 2
    else:
        shape, dev, prefills, decodes = Shape(), torch.device("cuda"), PREFILLS, DECODES
    torch.manual_seed(0)
    model = Model(shape, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU check"
    env = f"{name}, torch {torch.__version__}, bf16, random weights, {shape.params / 1e9:.2f} B parameters"
    print(env, flush=True)
    context = sdpa_kernel(FUSED) if dev.type == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), context:
        rows = measure(model, prefills, decodes, args.reps, env)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w", newline="") as f:
        f.write(f"# Measured by testbed/profile/step_times.py: {env}.\n")
        w = csv.writer(f)
        w.writerow(["kind", "tokens", "context", "batch", "devices", "ms", "dtype_bytes", "source"])
        w.writerows(rows)
    os.replace(tmp, args.out)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
