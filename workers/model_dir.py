"""What the orchestrator needs to know of a model directory without loading torch: its
KV bytes per token, from ``config.json`` alone (the same arithmetic as ``ModelShape``)."""

from __future__ import annotations

import json
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def kv_bytes_per_token(path: Path | str, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes of ``dtype``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[dtype]
