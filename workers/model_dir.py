"""What the orchestrator needs to know of a model directory without loading torch: where
the default model lives, and its KV bytes per token from ``config.json`` alone (the same
arithmetic as ``ModelShape``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "pdd-tiny-llama-v2"
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def default_model_dir() -> Path:
    root = Path(os.environ.get("PDD_TESTBED_CACHE", Path(__file__).resolve().parent.parent / ".cache"))
    return root / "models" / DEFAULT_MODEL_NAME


def kv_bytes_per_token(path: Path | str, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes of ``dtype``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[dtype]
