"""What the orchestrator and a modeled worker need to know of a model directory without
loading torch or transformers: where the default model lives, its configuration
(``config.json``, checked), and the KV layout's one rule (``kv_dims``: the real runner's
``ModelShape`` and the KV bytes per token alike)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DEFAULT_MODEL_NAME = "pdd-tiny-llama-v2"
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def default_model_dir() -> Path:
    root = Path(os.environ.get("PDD_TESTBED_CACHE", Path(__file__).resolve().parent.parent / ".cache"))
    return root / "models" / DEFAULT_MODEL_NAME


def read_config(path: Path | str) -> SimpleNamespace:
    """The ``config.json`` of the model directory ``path`` as attributes (the names
    transformers' config objects have), checked before anything sizes KV by it."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read the model's configuration ({e})") from None
    needed = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
    missing = [k for k in needed if k not in data] if isinstance(data, dict) else list(needed)
    if missing:
        raise ValueError(f"{file}: not a model configuration (missing {', '.join(missing)})")
    for k in (*needed, "num_key_value_heads", "head_dim"):
        v = data.get(k)
        if v is not None and (type(v) is not int or v < 1):
            raise ValueError(f"{file}: {k}: {v!r} is not a positive integer")
    return SimpleNamespace(**data)


def kv_dims(cfg: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model configuration (``read_config``'s or
    transformers'): a model without ``num_key_value_heads`` has one KV head per attention
    head, one without ``head_dim`` divides its hidden size among its heads."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(path: Path | str, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes of ``dtype``."""
    layers, kv_heads, head_dim = kv_dims(read_config(path))
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
