"""The OpenAI-compatible API's shapes: every request body it accepts and every body it
returns, as typed models (the HTTP side of ``testbed serve``).

The subset is what benchmark clients send (vLLM's ``bench serve``, aiperf, GuideLLM, the
``openai`` library): a prompt as text or token ids, chat messages, ``max_tokens``
(``max_completion_tokens``), ``stream`` with ``stream_options.include_usage``,
``ignore_eos``, greedy decoding. A parameter that would change what is generated and that
the emulation does not do (sampling, several choices, stop strings, log-probabilities...)
is refused with a 400 naming it, never ignored; fields that change nothing here (``user``,
``seed``...) are accepted. ``temperature`` absent or 0 is greedy; anything else is refused.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

# Accepted and without effect here: they do not change what a greedy decoder generates.
NO_EFFECT = {"user", "seed", "top_k", "min_p", "repetition_penalty", "skip_special_tokens",
             "spaces_between_special_tokens", "metadata", "store", "service_tier"}  # fmt: skip
# Refused unless they hold their neutral value: (neutral values, why).
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_p": ((None, 1, 1.0), "only greedy decoding is emulated"),
    "n": ((None, 1), "one choice per request"),
    "best_of": ((None, 1), "one choice per request"),
    "stop": ((None, [], ""), "stop strings are not supported (max_tokens and the end-of-sequence token end a request)"),
    "stop_token_ids": ((None, []), "stop tokens other than the end-of-sequence token are not supported"),
    "logprobs": ((None, False, 0), "log-probabilities are not returned"),
    "top_logprobs": ((None, 0), "log-probabilities are not returned"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    "presence_penalty": ((None, 0, 0.0), "penalties are not emulated"),
    "frequency_penalty": ((None, 0, 0.0), "penalties are not emulated"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "tools": ((None, []), "tool calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "response_format": ((None, {"type": "text"}), "structured output is not supported"),
    "min_tokens": ((None, 0), "min_tokens is not supported (ignore_eos runs to max_tokens)"),
}


class ApiError(Exception):
    """An error answered as OpenAI does: an HTTP status and an ``ErrorBody``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))


class _Api(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Api):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """What both endpoints share. Unknown fields are collected and judged (``unsupported``)
    rather than rejected by pydantic, so the error says why a field is refused."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _judge_extras(self) -> _GenerationRequest:
        if self.temperature:
            raise ValueError("temperature: only greedy decoding (temperature 0) is emulated")
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name in NEUTRAL:
                neutral, why = NEUTRAL[name]
                if value not in neutral:
                    raise ValueError(f"{name}: {why}")
                continue
            raise ValueError(f"{name}: unsupported parameter")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids (or a list of one of them)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (a batch of prompts is not supported)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v  # type: ignore[return-value]


class TextPart(_Api):
    type: Literal["text"]
    text: str


class ChatMessage(_Api):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ------------------------------------------------------------------------------ responses
class ErrorDetail(_Api):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Api):
    error: ErrorDetail


class Usage(_Api):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


FinishReason = Literal["stop", "length"]


class CompletionChoice(_Api):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(_Api):
    """A completion, or (``object`` = ``text_completion`` too, as OpenAI does) one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Api):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Api):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(_Api):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Api):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # as OpenAI sends a delta


class ChatChunkChoice(_Api):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Api):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Api):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdd-testbed"
    max_model_len: int


class ModelList(_Api):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(_Api):
    status: Literal["ok", "starting", "router down"]
    policy: str
    model: str
