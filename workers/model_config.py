"""A model's KV shape as the workers hold it (torch dtypes), by the rule ``workers.model_dir``
states once for every reader of a model's configuration: the real runner reads the fields
from transformers' config object, a modeled worker from ``config.json`` (importing
transformers costs ~2.5 s and ~150 MB, for a model it never runs).
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.kv_format import ModelShape  # the KV layout is the wire format's contract
from workers.model_dir import kv_dims

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def shape_of(cfg: Any, dtype: str) -> ModelShape:
    """The KV layout of a model configuration (transformers' or ``model_dir.read_config``'s)."""
    return ModelShape(*kv_dims(cfg), DTYPES[dtype])
