"""Simple request lists (``testbed run --requests FILE.jsonl``); the trace replayer generalises this.

One JSON object per line: ``prompt`` (token IDs) or ``input_length`` (tokens synthesised
deterministically from ``prefix`` group and line), ``output_length``, ``arrival_s``.
Optional ``rid`` and ``prefix`` (a group name: requests with the same group share their
first ``prefix_length`` tokens). Errors name file:line:field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from testbed.client import RequestSpec
from testbed.errors import InputError

VOCAB_LOW, VOCAB_HIGH = 3, 32000  # ids 0..2 are pad/bos/eos


class RequestLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    prompt: list[int] | None = None
    input_length: int | None = Field(default=None, ge=1)
    prefix: str | None = None
    prefix_length: int = Field(default=0, ge=0)
    output_length: int = Field(ge=1)
    arrival_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestLine:
        if (self.prompt is None) == (self.input_length is None):
            raise ValueError("give exactly one of prompt or input_length")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.input_length is not None and self.prefix_length > self.input_length:
            raise ValueError("prefix_length exceeds input_length")
        return self


def synth_tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def load_requests(path: Path) -> list[RequestSpec]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from e
    specs, last = [], 0.0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = RequestLine.model_validate(json.loads(line))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{i}: not valid JSON: {e.msg}") from e
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or "(line)"
            raise InputError(f"{path}:{i}: {field}: {err['msg'].removeprefix('Value error, ')}") from e
        if r.arrival_s < last:
            raise InputError(f"{path}:{i}: arrival_s: goes backwards ({r.arrival_s} < {last})")
        last = r.arrival_s
        if r.prompt is not None:
            prompt = r.prompt
        else:
            assert r.input_length is not None
            head = synth_tokens(f"prefix:{r.prefix}", r.prefix_length) if r.prefix else []
            prompt = head + synth_tokens(f"{path.name}:{i}", r.input_length - len(head))
        specs.append(RequestSpec(r.rid or f"r{i:05d}", prompt, r.output_length, r.arrival_s))
    if not specs:
        raise InputError(f"{path}: no requests")
    return specs
