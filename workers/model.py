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

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from workers.model_config import DTYPES, shape_of
from workers.model_dir import default_model_dir
from workers.tokenizer import ensure_tokenizer

DEFAULT_CONFIG = {
    # A 19 M-parameter Llama shape measured on this class of host (KV 4096 B/token in fp32),
    # with an 8192-token vocabulary instead of 32000: 6.8 M parameters instead of 19.3 M. The
    # output projection reads every vocabulary row per forward pass (32 MB in fp32: 4 ms on this host, half of a small
    # prefill or a one-token extend), and those fixed costs set the time dilation.
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Wider than the usual 0.02 so greedy choices have clear logit margins.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
DEFAULT_SEED = 20261129


def ensure_default_model(path: Path | None = None) -> Path:
    """Create the default model once (fixed config and seed) with ``save_pretrained``, and
    its character tokenizer (``workers.tokenizer``; added to a model made before it)."""

    path = path or default_model_dir()
    if (path / "config.json").exists():
        return ensure_tokenizer(path)
    torch.manual_seed(DEFAULT_SEED)
    model = LlamaForCausalLM(LlamaConfig(**DEFAULT_CONFIG))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # a fresh name, no one else's
    tmp.chmod(0o755)  # as a model directory is: readable by the accounts the components become
    model.save_pretrained(tmp)
    ensure_tokenizer(tmp)
    try:
        tmp.replace(path)
    except OSError:
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp)  # another process won the race; both wrote the same model
    return path


def _grouped_query_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for one-token decode steps with grouped KV heads:
    there the query heads that share a KV head are folded into the query-length dimension,
    so the KV is read in place instead of being repeated (copied) per query head, which
    dominated a batched decode step on the CPU. Same arithmetic per query row."""
    b, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(b, kv_heads, heads // kv_heads, d)  # head h uses KV head h // (heads / kv_heads)
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


ATTN_IMPLEMENTATION = "pdd_grouped_sdpa"
AttentionInterface.register(ATTN_IMPLEMENTATION, _grouped_query_sdpa)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

class ModelRunner:
    """One model instance. Not thread-safe: one worker drives it from one thread."""

    def __init__(self, path: Path | str, dtype: str = "float32", threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        self.model.eval()
        if self.model.config._attn_implementation == "sdpa":
            self.model.config._attn_implementation = ATTN_IMPLEMENTATION
        cfg = self.model.config
        self.eos_token_id: int | None = cfg.eos_token_id
        self.shape = shape_of(cfg, dtype)
        self.params = sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------- helpers
    def _buffer(self, parts: list[torch.Tensor], total: int) -> tuple[torch.Tensor, Cache]:
        """One (L, 2, H, ``total``, D) buffer holding ``parts`` (consecutive KV pieces) at its
        start, and a cache whose forward passes write the following tokens into it in place."""
        s = self.shape
        kv = torch.empty((s.layers, 2, s.kv_heads, total, s.head_dim), dtype=s.dtype)
        at = 0
        for p in parts:
            kv[:, :, :, at : at + p.shape[3]] = p
            at += p.shape[3]
        return kv, Cache(layers=[_PreallocatedLayer(kv[i, 0][None], kv[i, 1][None], at) for i in range(s.layers)])

    # ----------------------------------------------------------------- compute
    @torch.inference_mode()
    def prefill(self, tokens: list[int], cached: torch.Tensor | list[torch.Tensor] | None,
                chunk: int) -> tuple[torch.Tensor, int]:
        """Compute KV for the tokens after the cached prefix, in chunks on top of it.

        ``cached`` is the prefix's KV, whole or as consecutive blocks (a radix-cache path).
        Returns the KV of the whole prompt and the first generated (greedy) token. The
        result is one buffer the forward passes write into: the prefix is copied in once,
        where a ``DynamicCache`` would concatenate the whole context per layer per chunk and
        copy it again to stack the result (most of a small prefill's time on the CPU).
        """
        parts = [] if cached is None else [cached] if isinstance(cached, torch.Tensor) else cached
        done = sum(p.shape[3] for p in parts)
        if done >= len(tokens):
            raise ValueError("prefill needs at least one uncached token")
        kv, cache = self._buffer(parts, len(tokens))
        logits = None
        for start in range(done, len(tokens), chunk):
            piece = torch.tensor([tokens[start : start + chunk]])
            pos = torch.arange(start, start + piece.shape[1])[None]
            # Only the last position's logits are used: skip the vocabulary projection elsewhere.
            out = self.model(input_ids=piece, position_ids=pos, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            logits = out.logits[0, -1]
        assert logits is not None
        return kv, int(torch.argmax(logits))

    @torch.inference_mode()
    def extend(self, kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Feed several known tokens in one pass on top of ``kv`` (PDD's extend-decode).

        Returns the KV of the new tokens and the greedy token after each of them. The context
        is copied once into a buffer the pass writes into (as in ``prefill``).
        """
        n = kv.shape[3]
        buf, cache = self._buffer([kv], n + len(tokens))
        pos = torch.arange(n, n + len(tokens))[None]
        out = self.model(input_ids=torch.tensor([tokens]), position_ids=pos, past_key_values=cache, use_cache=True)
        return buf[:, :, :, n:].clone(), out.logits[0].argmax(-1).tolist()

    def batch(self, kvs: list[torch.Tensor], headroom: int = 64, spare: int = 0,
              reuse: DecodeBatch | None = None) -> DecodeBatch:
        """A decode batch over these requests' KV, kept across steps (``DecodeBatch``)."""
        return DecodeBatch(self, kvs, headroom=headroom, spare=spare, reuse=reuse)

    def decode_step(self, batch: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
        """One batched forward pass: for each (kv, last_token) return (new-token KV, next token).

        A one-off ``DecodeBatch``; a decode worker keeps its batch across steps instead.
        """
        return DecodeBatch(self, [kv for kv, _ in batch], headroom=1).step([tok for _, tok in batch])

    @torch.inference_mode()
    def reference(self, tokens: list[int], max_new: int) -> list[int]:
        """Single-process greedy reference: transformers ``generate(do_sample=False)``."""
        out = self.model.generate(
            torch.tensor([tokens]), attention_mask=torch.ones((1, len(tokens)), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos_token_id,
            pad_token_id=self.eos_token_id,
        )  # fmt: skip
        return out[0, len(tokens) :].tolist()


class _PreallocatedLayer(DynamicLayer):
    """A cache layer whose keys/values are views into a preallocated buffer: a step writes
    its new column in place instead of concatenating (which would copy the whole batch)."""

    def __init__(self, buf_k: torch.Tensor, buf_v: torch.Tensor, end: int) -> None:
        super().__init__()
        self.buf_k, self.buf_v, self.end = buf_k, buf_v, end
        self.dtype, self.device = buf_k.dtype, buf_k.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.buf_k[:, :, : self.end]
        self.values = self.buf_v[:, :, : self.end]

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        q = key_states.shape[-2]
        if self.end + q > self.buf_k.shape[2]:
            raise RuntimeError("decode batch buffer full")
        self.buf_k[:, :, self.end : self.end + q] = key_states
        self.buf_v[:, :, self.end : self.end + q] = value_states
        self.end += q
        self._views()
        return self.keys, self.values


REUSE_MIN_ROOM = 64  # columns a reused buffer must have left past the new end


class DecodeBatch:
    """The KV of a decode batch, left-padded into one preallocated buffer per layer and kept
    across steps: every step appends one column for all rows (left padding keeps rows
    aligned at the right), so the context is copied once, not at every step.

    Members come and go without copying the others: ``add`` copies one request's KV into a
    spare row, ``remove`` moves the last row into the freed one, so live rows stay
    ``[0, rows)`` and a step computes only those. A joiner longer than the batch's aligned
    end moves the end instead: the other rows get a masked hole there (a row's positions
    need not be contiguous columns: each row has its own position ids and mask). Only when
    the headroom is used up is the batch rebuilt, into the old buffers when they are big
    enough (a rebuild into fresh memory took ~0.9 s for 23 requests under load, mostly page
    faults). Results equal decoding each request alone (exactly, in float64). Masked
    columns need not be zero, only finite: they get weight 0, and 0 x NaN would not be 0."""

    def __init__(self, runner: ModelRunner, kvs: list[torch.Tensor], headroom: int = 64, spare: int = 0,
                 reuse: DecodeBatch | None = None) -> None:
        self.runner = runner
        self.end = max(kv.shape[3] for kv in kvs)
        s = runner.shape
        rows, cap = len(kvs) + spare, self.end + max(1, headroom)
        room = (reuse is not None and reuse.bufs[0][0].shape[0] >= len(kvs)
                and reuse.cap >= self.end + min(headroom, REUSE_MIN_ROOM))
        if reuse is not None and room:
            self.bufs, self.cap = reuse.bufs, reuse.cap
        else:
            # Columns past ``end`` are written by a step before any step reads them; padding
            # and holes are zeroed as they appear.
            shape = (rows, s.kv_heads, cap, s.head_dim)
            self.bufs = [(torch.empty(shape, dtype=s.dtype), torch.empty(shape, dtype=s.dtype))
                         for _ in range(s.layers)]
            self.cap = cap
        self.lens: list[int] = []
        self.starts: list[int] = []
        self.holes: list[list[tuple[int, int]]] = []  # per row: masked column ranges inside [start, end)
        for kv in kvs:
            self._fill(kv)

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def full(self) -> bool:
        return self.end >= self.cap

    def fits(self, kv: torch.Tensor) -> bool:
        """Whether ``kv`` can join without a rebuild: a spare row, and room for its length."""
        return self.rows < self.bufs[0][0].shape[0] and max(self.end, kv.shape[3]) < self.cap

    def add(self, kv: torch.Tensor) -> None:
        """Copy one more request's KV ``(layers, 2, kv_heads, n, head_dim)`` in as the last row."""
        if not self.fits(kv):
            raise ValueError("request does not fit this decode batch")
        n = kv.shape[3]
        if n > self.end:  # the others skip the columns up to the new end
            for k, v in self.bufs:
                k[: self.rows, :, self.end : n] = 0
                v[: self.rows, :, self.end : n] = 0
            for holes in self.holes:
                holes.append((self.end, n))
            self.end = n
        self._fill(kv)

    def remove(self, row: int) -> None:
        """Drop ``row``; the last row takes its place (callers mirror that move)."""
        last = self.rows - 1
        if row != last:
            a = self.starts[last]
            for k, v in self.bufs:
                k[row, :, a : self.end] = k[last, :, a : self.end]
                v[row, :, a : self.end] = v[last, :, a : self.end]
            self.starts[row], self.lens[row], self.holes[row] = a, self.lens[last], self.holes[last]
        self.starts.pop()
        self.lens.pop()
        self.holes.pop()

    def _fill(self, kv: torch.Tensor) -> None:
        row, n = self.rows, kv.shape[3]
        start = self.end - n
        for layer, (k, v) in enumerate(self.bufs):
            k[row, :, :start] = 0
            v[row, :, :start] = 0
            k[row, :, start : self.end] = kv[layer, 0]
            v[row, :, start : self.end] = kv[layer, 1]
        self.starts.append(start)
        self.lens.append(n)
        self.holes.append([])

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> list[tuple[torch.Tensor, int]]:
        """Feed each row's last token; returns each row's (new-token KV, next greedy token)."""
        bsz = len(tokens)
        assert bsz == self.rows, (bsz, self.rows)
        views = [(k[:bsz], v[:bsz]) for k, v in self.bufs]
        cache = Cache(layers=[_PreallocatedLayer(k, v, self.end) for k, v in views])
        mask = torch.zeros((bsz, self.end + 1), dtype=torch.long)
        for row, start in enumerate(self.starts):
            mask[row, start:] = 1
            for a, b in self.holes[row]:
                mask[row, a:b] = 0
        ids = torch.tensor([[t] for t in tokens])
        pos = torch.tensor([[n] for n in self.lens])
        out = self.runner.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True)
        nxt = out.logits[:, -1].argmax(-1).tolist()
        e = self.end
        self.end += 1
        self.lens = [n + 1 for n in self.lens]
        return [
            (torch.stack([torch.stack((k[r, :, e : e + 1], v[r, :, e : e + 1])) for k, v in views]), nxt[r])
            for r in range(bsz)
        ]
