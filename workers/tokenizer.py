"""The default model's tokenizer: one token per character, built here and saved beside the
model with ``save_pretrained`` (no hub), so ``AutoTokenizer.from_pretrained(model_dir)`` works
for us and for any client that wants a tokenizer path.

What it guarantees, and why it is character-level rather than a trained BPE:

* **Prefix property.** Every character is one token, whatever its neighbours, so
  ``encode(a + b)`` starts with ``encode(a)``: equal text prefixes give equal token prefixes
  and the prefix caches hit on text exactly as they do on token ids (a BPE merge across the
  boundary would change the last tokens of a prefix).
* **Round trip.** Every id of the model's vocabulary decodes to one character (ids 0-2 are
  the special tokens), so generated output is text that encodes back to the same ids; text
  of the vocabulary's characters decodes back to itself. Any other character is ``<unk>``.

The vocabulary: ``<unk>`` (also padding), ``<s>``, ``</s>`` at the model's ids 0, 1, 2;
newline, tab and printable ASCII next; then CJK ideographs from U+4E00 up to the model's
vocabulary size (8192 for the default model), so a random small model's output is
readable as characters.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the default model's pad/unknown, bos, eos
CJK_START = 0x4E00
# Messages in, one prompt out: role markers stay plain characters, so a conversation's
# history is a text prefix (and a token prefix) of its next turn.
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif -%}"
)


def vocabulary(size: int) -> dict[str, int]:
    """Character (or special token) -> id for a model vocabulary of ``size`` ids."""
    chars = ["\n", "\t", *(chr(c) for c in range(0x20, 0x7F))]
    n_cjk = size - len(SPECIALS) - len(chars)
    if n_cjk < 0 or CJK_START + n_cjk > 0x9FFF:
        raise ValueError(f"a character vocabulary cannot have {size} ids (between 100 and 20,895)")
    chars += [chr(CJK_START + i) for i in range(n_cjk)]
    return {tok: i for i, tok in enumerate([*SPECIALS, *chars])}


def build_tokenizer(vocab_size: int, max_length: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()  # characters join without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=max_length, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        split_special_tokens=True,  # "</s>" typed in a prompt is four characters, not the end of sequence
    )  # fmt: skip


def ensure_tokenizer(model_dir: Path) -> Path:
    """Write the character tokenizer into ``model_dir`` unless it has one (a user's own
    model directory keeps its own tokenizer)."""
    import json
    import os
    import shutil

    if (model_dir / "tokenizer_config.json").exists():
        return model_dir
    cfg = json.loads((model_dir / "config.json").read_text())
    tmp = model_dir / f".tokenizer.tmp{os.getpid()}"
    build_tokenizer(cfg["vocab_size"], cfg.get("max_position_embeddings", 4096)).save_pretrained(tmp)
    # Each file lands whole (a concurrent writer writes the same bytes); the config last,
    # since its presence is what says the tokenizer is there.
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer_config.json"):
        os.replace(f, model_dir / f.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
