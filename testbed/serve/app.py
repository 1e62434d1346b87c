"""The OpenAI-compatible HTTP endpoints of ``testbed serve`` (aiohttp).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events,
one chunk per generated token, or answered whole), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Requests are validated against ``testbed.serve.openai_api``; an invalid or
unsupported one is answered with a 4xx and an OpenAI-style error body, and the server
serves on. The tokens come from ``Gateway.generate`` (the emulated datacenters).

A failure after a stream has started (a worker died, the request timed out) cannot change
the status any more: it is sent as a ``data: {"error": ...}`` event before ``[DONE]``, as
vLLM does.

Bounds, checked before any work (the loop that serves HTTP also timestamps every token):
a body over ``body_limit`` is refused with 413 before it is parsed; a text prompt longer
than ``MAX_CHARS_PER_TOKEN`` characters per token of context with 400 before it is
tokenized, and tokenizing happens on a thread of its own; beyond ``max_concurrency``
requests at once the answer is 429 (the OpenAI SDK backs off and retries); a chat request
without ``max_tokens`` gets ``default_max_tokens`` (at most what the context leaves).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from protocol.validation import field_errors
from testbed.serve.gateway import Gateway, NotReady, RequestFailed
from testbed.serve.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    FinishReason,
    Health,
    ModelCard,
    ModelList,
    Usage,
)  # fmt: skip
from testbed.serve.prometheus import CONTENT_TYPE, ServeMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# No tokenizer makes a token of more characters than this in text anyone sends (a run of
# spaces in code is the longest usual case): a longer prompt cannot fit the context.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Served:
    """What the front end serves: the model's name and limits and the policy behind it."""

    model: str
    max_len: int  # the model's context: prompt + max_tokens
    vocab: int
    eos: int | None
    policy: str
    created: int
    max_concurrency: int = 256  # requests at once; more are answered 429
    # A request holds one of those slots: a client that sends its body this slowly, or takes a
    # streamed chunk this slowly, is let go (408, or its stream cut) and the slot freed.
    body_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    default_max_tokens: int = 1024  # a chat request's when it sets none (bounded by the context left)

    @property
    def body_limit(self) -> int:
        """Bytes of a request body: a whole context of token ids as JSON, or of text, with room."""
        return max(1 << 20, 8 * MAX_CHARS_PER_TOKEN * self.max_len)


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=model.model_dump_json(), status=status, content_type="application/json")


def _invalid(e: ValidationError) -> ApiError:
    err = field_errors(e)[0]
    where = ".".join(str(p) for p in err.loc if not isinstance(p, int) or len(err.loc) > 1)
    return ApiError(400, f"{where}: {err.msg}" if where else err.msg, param=where or None)


class Detokenizer:
    """Text of each new token, for any tokenizer: the difference between decoding a few
    tokens of context with and without it (a BPE token decoded alone can lose a leading
    space or split a character; a character not yet complete is held back)."""

    CONTEXT = 6

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.ids, self.pending = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        start = max(0, len(self.ids) - 1 - self.pending - self.CONTEXT)
        before = self.tok.decode(self.ids[start : len(self.ids) - 1 - self.pending], skip_special_tokens=True)
        after = self.tok.decode(self.ids[start:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            self.pending += 1
            return ""
        self.pending = 0
        return after[len(before) :]


class OpenAiFront:
    def __init__(self, gateway: Gateway, tokenizer: Any, served: Served, metrics: ServeMetrics) -> None:
        self.gw, self.tok, self.served, self.metrics = gateway, tokenizer, served, metrics
        self.active = 0  # requests being tokenized or generated
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._rendering = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="metrics")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.served.body_limit)
        app.on_cleanup.append(self._close)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return _json(e.body(), e.status)
        except web.HTTPException as e:  # unknown path or method: still an OpenAI-style body
            if e.status < 400:
                raise
            return _json(ApiError(e.status, f"{request.method} {request.path}: {e.reason}").body(), e.status)

    # ------------------------------------------------------------------ endpoints
    async def models(self, _request: web.Request) -> web.Response:
        s = self.served
        return _json(ModelList(data=[ModelCard(id=s.model, created=s.created, max_model_len=s.max_len)]))

    async def health(self, _request: web.Request) -> web.Response:
        ok = self.gw.ready and self.gw.broker_up  # the router's word, through a broker that is there
        status = ("ok" if ok else "broker unreachable" if not self.gw.broker_up
                  else "starting" if self.gw.router_state == "starting" else "router down")
        return _json(Health(status=status, policy=self.served.policy, model=self.served.model), 200 if ok else 503)

    async def prometheus(self, _request: web.Request) -> web.Response:
        # Rendering reads the workers' statistics files and asks for the delay line's: not on
        # the loop that timestamps tokens.
        body = await asyncio.get_running_loop().run_in_executor(self._rendering, self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _close(self, _app: web.Application) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self._rendering.shutdown(wait=False, cancel_futures=True)

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """One of at most ``max_concurrency`` requests in progress, or a 429."""
        if self.active >= self.served.max_concurrency:
            raise ApiError(429, f"{self.active} requests in progress, at most {self.served.max_concurrency} at once: "
                           "retry later", type_="rate_limit_error", code="rate_limit_exceeded")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def _tokenize(self, texts: list[str], encode: Callable[[], list[int]]) -> list[int]:
        """``encode()`` on the tokenizing thread, once the text could fit the context at all."""
        chars = sum(len(t) for t in texts)
        if chars > MAX_CHARS_PER_TOKEN * self.served.max_len:
            raise ApiError(400, f"prompt: {chars} characters cannot fit this model's context of {self.served.max_len} "
                           "tokens", param="prompt", code="context_length_exceeded")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted():
            return await self._completion(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted():
            return await self._chat(request)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        if isinstance(body.prompt, str):
            text = body.prompt
            prompt = await self._tokenize([text], lambda: self.tok.encode(text, add_special_tokens=False))
        else:
            prompt = list(body.prompt)  # type: ignore[arg-type]
            bad = next((t for t in prompt if not 0 <= t < self.served.vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (0..{self.served.vocab - 1})",
                               param="prompt")
        return await self._generate(request, body, prompt, body.max_tokens or DEFAULT_MAX_TOKENS, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]

        def encode() -> list[int]:
            ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            return ids if isinstance(ids, list) else list(ids["input_ids"])  # a BatchEncoding from some tokenizers

        prompt = await self._tokenize([str(m["content"]) for m in messages], encode)
        max_new = body.max_new or max(1, min(self.served.default_max_tokens, self.served.max_len - len(prompt)))
        return await self._generate(request, body, prompt, max_new, chat=True)

    # ------------------------------------------------------------------ shared
    async def _parse(self, request: web.Request, model: type[BaseModel]) -> BaseModel:
        try:
            async with asyncio.timeout(self.served.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.served.body_timeout_s:g} s",
                           code="request_timeout") from None
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise _invalid(e) from None
        if body.model != self.served.model:  # type: ignore[attr-defined]
            raise ApiError(404, f"The model `{body.model}` does not exist (this server has "  # type: ignore[attr-defined]
                           f"`{self.served.model}`).", param="model", code="model_not_found")
        return body

    def _check_length(self, prompt: list[int], max_new: int) -> None:
        if not prompt:
            raise ApiError(400, "prompt: empty after tokenization", param="prompt")
        if len(prompt) + max_new > self.served.max_len:
            raise ApiError(400, f"This model's maximum context length is {self.served.max_len} tokens. However, you "
                           f"requested {len(prompt) + max_new} tokens ({len(prompt)} in the prompt, {max_new} in the "
                           "completion). Please reduce the length of the prompt or of max_tokens.",
                           param="max_tokens", code="context_length_exceeded")

    def _finish(self, out: list[int], ignore_eos: bool) -> FinishReason:
        return "stop" if out and not ignore_eos and out[-1] == self.served.eos else "length"

    async def _generate(self, request: web.Request, body: Any, prompt: list[int], max_new: int,
                        chat: bool) -> web.StreamResponse:
        self._check_length(prompt, max_new)
        if not self.gw.ready:
            why = "is still starting" if self.gw.router_state == "starting" else "has no router (it went down)"
            raise ApiError(503, f"the emulation {why}", type_="server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.metrics.running.inc()
        try:
            # Closed on every way out (a client that went away included): the request's record
            # then says how it ended before it is counted.
            async with contextlib.aclosing(self.gw.generate(prompt, max_new, body.ignore_eos, rid)) as stream:
                if body.stream:
                    return await self._stream(request, body, rid, prompt, max_new, stream, chat)
                out: list[int] = []
                try:
                    async for new in stream:
                        out.extend(new)
                except RequestFailed as e:
                    raise ApiError(500, f"request {rid} failed: {e}", type_="server_error") from None
                except NotReady as e:
                    raise ApiError(503, str(e), type_="server_error") from None
            text = self.tok.decode(out, skip_special_tokens=True)
            usage = Usage.of(len(prompt), len(out))
            finish = self._finish(out, body.ignore_eos)
            if chat:
                return _json(ChatCompletion(id=rid, model=self.served.model, usage=usage, choices=[
                    ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)]))
            return _json(Completion(id=rid, model=self.served.model, usage=usage,
                                    choices=[CompletionChoice(text=text, finish_reason=finish)]))
        finally:
            self.metrics.running.dec()
            rec = self.gw.finish(rid)  # written to disk, out of memory
            if rec is not None:
                self.metrics.ended(rec)

    async def _stream(self, request: web.Request, body: Any, rid: str, prompt: list[int], max_new: int,
                      stream: Any, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._events(resp, body, rid, prompt, max_new, stream, chat)
        except ConnectionResetError:
            pass  # the client went away: its record says so
        except TimeoutError:  # the client stopped taking what it asked for: cut, and its slot freed
            if request.transport is not None:
                request.transport.abort()
        return resp

    async def _events(self, resp: web.StreamResponse, body: Any, rid: str, prompt: list[int], max_new: int,
                      stream: Any, chat: bool) -> None:
        """The server-sent events of one request: a chunk per token, usage, ``[DONE]``."""
        model = self.served.model

        async def send(chunk: BaseModel | str) -> None:
            data = chunk if isinstance(chunk, str) else chunk.model_dump_json()
            async with asyncio.timeout(self.served.write_timeout_s):  # a client that reads nothing
                await resp.write(f"data: {data}\n\n".encode())

        detok = Detokenizer(self.tok)
        out: list[int] = []
        if chat:
            await send(ChatCompletionChunk(id=rid, model=model, choices=[
                ChatChunkChoice(delta=Delta(role="assistant", content=""))]))
        try:
            async for new in stream:
                for i, token in enumerate(new):
                    out.append(token)
                    text = detok.add(token)
                    last = i == len(new) - 1 and (len(out) >= max_new or self._finish(out, body.ignore_eos) == "stop")
                    finish = self._finish(out, body.ignore_eos) if last else None
                    if chat:
                        await send(ChatCompletionChunk(id=rid, model=model, choices=[
                            ChatChunkChoice(delta=Delta(content=text), finish_reason=finish)]))
                    else:
                        await send(Completion(id=rid, model=model, choices=[
                            CompletionChoice(text=text, finish_reason=finish)]))
        except (RequestFailed, NotReady) as e:
            await send(ApiError(500, f"request {rid} failed: {e}", type_="server_error").body())
        else:
            if body.include_usage:
                usage = Usage.of(len(prompt), len(out))
                if chat:
                    await send(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage))
                else:
                    await send(Completion(id=rid, model=model, choices=[], usage=usage))
        await send("[DONE]")
        async with asyncio.timeout(self.served.write_timeout_s):
            await resp.write_eof()
