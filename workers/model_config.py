"""A model's KV shape from its configuration, with or without transformers.

Importing transformers costs ~2.5 s and ~150 MB before a worker does anything. A modeled
worker (and so every simulated one) needs only the shape its KV has, which the model's
``config.json`` states; it reads that file here. The real runner (``workers.model``) reads
the same fields from transformers' config object. ``shape_of`` is the one rule both use.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from protocol.kv_format import ModelShape  # the KV layout is the wire format's contract

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def shape_of(cfg: Any, dtype: str) -> ModelShape:
    """The KV layout of a model configuration (transformers' or ``read_config``'s: the same
    attribute names): a model without ``num_key_value_heads`` has one KV head per attention
    head, one without ``head_dim`` divides its hidden size among its heads."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelShape(cfg.num_hidden_layers, kv_heads, head_dim, DTYPES[dtype])


def read_config(path: Path | str) -> SimpleNamespace:
    """The ``config.json`` of the model directory ``path`` as attributes."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read the model's configuration ({e})") from None
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size") if k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(f"{file}: not a model configuration (missing {', '.join(missing) or 'everything'})")
    return SimpleNamespace(**data)
