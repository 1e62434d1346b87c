"""The model directory a deployment runs, ready before anything reads it."""

from __future__ import annotations

import os
from pathlib import Path

from testbed.root_paths import open_folder
from workers.model_dir import default_model_dir


def ensure_model(path: str | Path) -> str:
    """``path`` ready to load: the default model is created there on first use (torch), a
    user's directory is taken as it is (the scenario validated it)."""
    path = Path(path)
    made = all((path / f).exists() for f in ("config.json", "tokenizer_config.json"))
    if path == default_model_dir() and not made:  # torch only to create it (~5 s of imports)
        from workers.model import ensure_default_model  # torch

        # Root writes it only where no other account could plant a link (``root_paths``).
        os.close(open_folder(path.parent))
        ensure_default_model(path)
    return str(path)
