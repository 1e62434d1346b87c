"""Modeled compute: the real runner's interface without a forward pass (``compute: modeled``).

A modeled worker is paced exactly as a real one (``workers/device.py``: the step's modeled
time on its emulated device), but the step itself costs next to nothing, so many emulated
instances fit on a few host cores (cluster scale, issue #10). What it guarantees:

* **KV of the real size.** Prefill and extend return KV tensors of the real small model's
  shape (``ModelShape``: layers x 2 x KV heads x tokens x head dim), so every transfer puts
  the bytes the scale mapping of ``docs/emulated-time.md`` gives on the emulated network,
  and caches hold what they would. Their content is zeros: nothing reads it, and they are
  views of one preallocated zero tensor (a sender ships them from cached zero frames).
* **Deterministic tokens.** The token after ``t`` at position ``p`` is a fixed function of
  ``(t, p)`` (``next_token``), so a relay's eager tokens and a main decoder's extend agree,
  as greedy decoding of one model would, and two runs produce the same streams. Never the
  end-of-sequence token: every request runs to its output length.
* **Nothing to verify.** These are not a model's tokens; ``testbed verify`` refuses
  scenarios with modeled workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.model_config import shape_of
from workers.model_dir import read_config

FIRST_ID = 3  # ids below are special tokens (bos, eos, pad) in the default model


class ModeledRunner:
    """Same calls as ``ModelRunner`` (``prefill``, ``extend``, ``batch``), no weights."""

    def __init__(self, path: Path | str, dtype: str = "float32") -> None:
        cfg = read_config(path)  # not transformers': a modeled worker never imports it
        self.shape = shape_of(cfg, dtype)
        self.vocab = int(cfg.vocab_size)
        self.eos_token_id: int | None = None  # outputs run to their length
        self._zero = torch.zeros((), dtype=self.shape.dtype)
        self._one = self.kv(1)  # a decode step's KV of one token, for every row

    def next_token(self, token: int, pos: int) -> int:
        """The token that follows ``token`` at position ``pos`` (a multiplicative hash)."""
        h = (token * 2654435761 + pos * 40503 + 12345) & 0xFFFFFFFF
        return FIRST_ID + h % (self.vocab - FIRST_ID)

    def kv(self, n: int) -> torch.Tensor:
        """KV of ``n`` tokens: one zero element expanded to the shape (no memory of its own),
        never written (the radix cache keeps views of it, a receiver hands one over after
        checking the blocks it was sent, a request keeps only its length). Allocating or
        copying megabytes per request stalled a modeled worker's event loop by up to 40 ms
        under load; a zero tensor grown to the longest context held 256 MB per instance at
        64K tokens."""
        s = self.shape
        return self._zero.expand(s.layers, 2, s.kv_heads, n, s.head_dim)

    def prefill(self, tokens: list[int], cached: object, chunk: int) -> tuple[torch.Tensor, int]:
        """KV of the whole prompt (what a real prefill returns) and the first output token."""
        return self.kv(len(tokens)), self.next_token(tokens[-1], len(tokens) - 1)

    def extend(self, kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """KV of ``tokens`` after ``kv``, and the token predicted after each of them."""
        n = kv.shape[3]
        return self.kv(len(tokens)), [self.next_token(t, n + i) for i, t in enumerate(tokens)]

    def batch(self, kvs: list[torch.Tensor], headroom: int = 64, spare: int = 0,
              reuse: object = None) -> ModeledBatch:
        return ModeledBatch(self, [kv.shape[3] for kv in kvs])


class ModeledBatch:
    """``DecodeBatch``'s interface over context lengths alone: rows come and go freely."""

    full = False

    def __init__(self, runner: ModeledRunner, lens: list[int]) -> None:
        self.runner = runner
        self.lens = lens

    @property
    def rows(self) -> int:
        return len(self.lens)

    def fits(self, kv: torch.Tensor) -> bool:
        return True

    def add(self, kv: torch.Tensor) -> None:
        self.lens.append(kv.shape[3])

    def remove(self, row: int) -> None:
        self.lens[row] = self.lens[-1]
        self.lens.pop()

    def step(self, tokens: list[int]) -> list[tuple[torch.Tensor, int]]:
        assert len(tokens) == self.rows, (len(tokens), self.rows)
        one, nxt = self.runner._one, self.runner.next_token
        out = [(one, nxt(t, n)) for t, n in zip(tokens, self.lens, strict=True)]
        self.lens = [n + 1 for n in self.lens]
        return out
