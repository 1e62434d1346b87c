"""Model runner: loads a causal LM with transformers and runs prefill, batched decode, extend.

KV layout used everywhere in the workers (and on the wire): one tensor per request of shape
``(layers, 2, kv_heads, tokens, head_dim)`` — index 0 of dim 1 is keys, 1 is values, keys
already rotated (RoPE) for their absolute positions, so a KV slice is position-correct
wherever it is concatenated or batched.

Greedy exactness: batched decode left-pads requests of different lengths; padding and
reduction order change floating-point results slightly. ``dtype=float64`` (the ``verify``
mode) makes that drift ~1e-15, far below any top-2 logit gap of the default model, so
greedy tokens match a single-process ``generate`` exactly.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

DEFAULT_MODEL_NAME = "pdd-tiny-llama-v1"
DEFAULT_CONFIG = {
    # PLATFORM.md's measured model: 19.3 M parameters, KV 4096 B/token in fp32.
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Wider than the usual 0.02 so greedy choices have clear logit margins.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
DEFAULT_SEED = 20261129


def default_model_dir() -> Path:
    root = Path(os.environ.get("PDD_TESTBED_CACHE", Path(__file__).resolve().parent.parent / ".cache"))
    return root / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(path: Path | None = None) -> Path:
    """Create the default model once (fixed config and seed) with ``save_pretrained``."""
    path = path or default_model_dir()
    if (path / "config.json").exists():
        return path
    torch.manual_seed(DEFAULT_SEED)
    model = LlamaForCausalLM(LlamaConfig(**DEFAULT_CONFIG))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    if path.exists():  # another process won the race; both wrote the same model
        shutil.rmtree(tmp)
    else:
        tmp.replace(path)
    return path


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def kv_bytes_per_token(path: Path | str, dtype: str) -> int:
    """KV bytes per token of a model directory, from its config alone (no weights loaded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, DTYPES[dtype]).kv_bytes_per_token


class ModelRunner:
    """One model instance. Not thread-safe: one worker drives it from one thread."""

    def __init__(self, path: Path | str, dtype: str = "float32", threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        self.model.eval()
        cfg = self.model.config
        self.eos_token_id: int | None = cfg.eos_token_id
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, DTYPES[dtype])
        self.params = sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _to_cache(kv: torch.Tensor) -> DynamicCache:
        """(L, 2, H, T, D) for one request -> DynamicCache of batch 1."""
        return DynamicCache.from_legacy_cache(tuple((kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])))

    @staticmethod
    def _from_cache(cache: DynamicCache, row: int = 0, start: int = 0) -> torch.Tensor:
        return torch.stack(
            [torch.stack((layer.keys[row, :, start:], layer.values[row, :, start:])) for layer in cache.layers]
        )

    def empty_kv(self) -> torch.Tensor:
        s = self.shape
        return torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=s.dtype)

    # ----------------------------------------------------------------- compute
    @torch.inference_mode()
    def prefill(self, tokens: list[int], cached: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, int]:
        """Compute KV for ``tokens[len(cached):]`` in chunks on top of ``cached``.

        Returns the KV of the whole prompt and the first generated (greedy) token.
        """
        done = 0 if cached is None else cached.shape[3]
        if done >= len(tokens):
            raise ValueError("prefill needs at least one uncached token")
        cache = self._to_cache(cached) if done else DynamicCache()
        logits = None
        for start in range(done, len(tokens), chunk):
            piece = torch.tensor([tokens[start : start + chunk]])
            pos = torch.arange(start, start + piece.shape[1])[None]
            out = self.model(input_ids=piece, position_ids=pos, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1]
        assert logits is not None
        return self._from_cache(cache), int(torch.argmax(logits))

    @torch.inference_mode()
    def extend(self, kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Feed several known tokens in one pass on top of ``kv`` (PDD's extend-decode).

        Returns the KV of the new tokens and the greedy token after each of them.
        """
        n = kv.shape[3]
        cache = self._to_cache(kv)
        pos = torch.arange(n, n + len(tokens))[None]
        out = self.model(input_ids=torch.tensor([tokens]), position_ids=pos, past_key_values=cache, use_cache=True)
        return self._from_cache(out.past_key_values, start=n), out.logits[0].argmax(-1).tolist()

    @torch.inference_mode()
    def decode_step(self, batch: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
        """One batched forward pass: for each (kv, last_token) return (new-token KV, next token).

        Requests of different lengths are left-padded; the padding is masked out and each
        request keeps its own position ids.
        """
        lens = [kv.shape[3] for kv, _ in batch]
        tmax = max(lens)
        s = self.shape
        bsz = len(batch)
        layers = []
        for layer in range(s.layers):
            k = torch.zeros((bsz, s.kv_heads, tmax, s.head_dim), dtype=s.dtype)
            v = torch.zeros_like(k)
            for row, (kv, _) in enumerate(batch):
                k[row, :, tmax - lens[row] :] = kv[layer, 0]
                v[row, :, tmax - lens[row] :] = kv[layer, 1]
            layers.append((k, v))
        cache = DynamicCache.from_legacy_cache(tuple(layers))
        mask = torch.zeros((bsz, tmax + 1), dtype=torch.long)
        for row, n in enumerate(lens):
            mask[row, tmax - n :] = 1
        ids = torch.tensor([[tok] for _, tok in batch])
        pos = torch.tensor([[n] for n in lens])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1).tolist()
        new = out.past_key_values
        return [
            (torch.stack([torch.stack((lay.keys[r, :, -1:], lay.values[r, :, -1:])) for lay in new.layers]), nxt[r])
            for r in range(bsz)
        ]

    @torch.inference_mode()
    def reference(self, tokens: list[int], max_new: int) -> list[int]:
        """Single-process greedy reference: transformers ``generate(do_sample=False)``."""
        out = self.model.generate(
            torch.tensor([tokens]), attention_mask=torch.ones((1, len(tokens)), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos_token_id,
            pad_token_id=self.eos_token_id,
        )  # fmt: skip
        return out[0, len(tokens) :].tolist()
