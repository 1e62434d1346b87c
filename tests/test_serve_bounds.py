"""``testbed serve``'s bounds, on the HTTP front end alone (a stand-in gateway, no network):
a body too large and a text that cannot fit are refused before any work, requests beyond
the concurrency limit get 429, a chat request without ``max_tokens`` gets a bounded one, and
seeded hostile bodies get a client error with a reason, never a crash."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from testbed.serve.app import MAX_CHARS_PER_TOKEN, OpenAiFront, Served

pytestmark = pytest.mark.hostile

MODEL = "m"


class _Tokenizer:
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += 1
        return [5 + ord(c) % 50 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class _Gateway:
    """Streams ``max_new`` tokens, each once ``release`` is set."""

    ready, router_state, broker_up = True, "ready", True

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked: list[int] = []

    def finish(self, rid: str) -> None:
        return None

    async def generate(self, prompt: list[int], max_new: int, ignore_eos: bool, rid: str) -> AsyncIterator[list[int]]:
        self.asked.append(max_new)
        for _ in range(max_new):
            await self.release.wait()
            yield [7]


class _Metrics:
    class _Gauge:
        def inc(self) -> None: ...
        def dec(self) -> None: ...

    running = _Gauge()

    def ended(self, rec: Any) -> None: ...


def _served(**kw: Any) -> Served:
    return Served(**{"model": MODEL, "max_len": 256, "vocab": 100, "eos": None, "policy": "pdd", "created": 0, **kw})


async def _with_client(served: Served, body: Any) -> Any:
    tok, gw = _Tokenizer(), _Gateway()
    front = OpenAiFront(gw, tok, served, _Metrics())  # type: ignore[arg-type]
    async with TestClient(TestServer(front.app())) as client:
        return await body(client, tok, gw)


def test_a_body_too_large_and_a_text_that_cannot_fit_are_refused_before_any_work() -> None:
    served = _served()

    async def body(client: TestClient, tok: _Tokenizer, gw: _Gateway) -> None:
        huge = json.dumps({"model": MODEL, "prompt": "a" * (served.body_limit + 10)})
        r = await client.post("/v1/completions", data=huge, headers={"Content-Type": "application/json"})
        assert r.status == 413 and "error" in await r.json()
        long = "a" * (MAX_CHARS_PER_TOKEN * served.max_len + 1)
        for path, req in (("/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 2}),
                          ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long}]})):
            r = await client.post(path, json=req)
            err = (await r.json())["error"]
            assert r.status == 400 and "cannot fit" in err["message"] and err["code"] == "context_length_exceeded"
        assert tok.encoded == 0 and gw.asked == []  # nothing tokenized, nothing sent

    asyncio.run(_with_client(served, body))


def test_requests_beyond_the_concurrency_limit_get_429_and_later_ones_are_served() -> None:
    async def body(client: TestClient, tok: _Tokenizer, gw: _Gateway) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                         "max_tokens": 3}))
        while not gw.asked:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        err = (await r.json())["error"]
        assert r.status == 429 and err["code"] == "rate_limit_exceeded" and "at most 1 at once" in err["message"]
        gw.release.set()
        assert (await first).status == 200
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3

    asyncio.run(_with_client(_served(max_concurrency=1), body))


def test_a_chat_request_without_max_tokens_gets_a_bounded_default() -> None:
    async def body(client: TestClient, tok: _Tokenizer, gw: _Gateway) -> None:
        gw.release.set()
        for content in ("short", "y" * 250):
            r = await client.post("/v1/chat/completions", json={"model": MODEL,
                                                                "messages": [{"role": "user", "content": content}]})
            assert r.status == 200, await r.text()
        assert gw.asked == [20, 256 - 250]  # the default, then what the context leaves

    asyncio.run(_with_client(_served(default_max_tokens=20), body))


def _fuzzed_bodies(rng: random.Random, n: int) -> list[bytes]:
    """Seeded hostile bodies: random bytes, broken JSON, JSON of every wrong type in every field."""
    values: list[Any] = [None, True, -1, 0, 2**63, 1e308, float("nan"), "", "x" * 300, [], {}, [1, "a"],
                         {"role": "user"}, [{"role": 5, "content": None}], "\u0000\ud7ff"]
    keys = ["model", "prompt", "messages", "max_tokens", "temperature", "stream", "n", "stop", "ignore_eos",
            "stream_options", "logprobs", "seed"]
    out: list[bytes] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(rng.randbytes(rng.randint(0, 200)))
        elif kind == 1:
            good = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
            out.append(good[: rng.randint(0, len(good) - 1)].encode())
        else:
            body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
            if kind == 3:
                body["model"] = MODEL
            out.append(json.dumps(body, allow_nan=True).encode())
    return out


def test_fuzzed_bodies_get_a_client_error_with_a_reason_and_the_server_serves_on() -> None:
    bodies = _fuzzed_bodies(random.Random(2026), 400)

    async def body(client: TestClient, tok: _Tokenizer, gw: _Gateway) -> None:
        gw.release.set()
        statuses: set[int] = set()
        for i, raw in enumerate(bodies):
            path = ("/v1/completions", "/v1/chat/completions")[i % 2]
            r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
            statuses.add(r.status)
            assert r.status < 500, (r.status, raw, await r.text())
            if r.status >= 400:
                assert (await r.json())["error"]["message"], raw
        assert 400 in statuses
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3

    asyncio.run(_with_client(_served(), body))


def test_a_client_too_slow_to_send_or_to_read_is_let_go_and_its_slot_freed() -> None:
    """With one slot: a client that announces a body and never sends it gets 408 after the
    body timeout; one that asks for a long stream and reads nothing has its stream cut after
    the write timeout. Either way the next request is served (no 429 for ever)."""
    async def body(client: TestClient, tok: _Tokenizer, gw: _Gateway) -> None:
        gw.release.set()
        host, port = client.server.host, client.server.port
        r, w = await asyncio.open_connection(host, port)
        w.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n".encode())
        answer = b""
        async with asyncio.timeout(5):  # the answer (the connection may be kept alive after it)
            while b"}}" not in answer:
                answer += await r.read(4096)
        w.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in answer, answer[:300]
        # A stream of 60,000 chunks (megabytes) to a client that reads none of it.
        r, w = await asyncio.open_connection(host, port)
        req = json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 60000, "stream": True})
        w.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(req)}\r\n\r\n{req}".encode())
        await w.drain()
        for _ in range(100):  # until the server gave up on it
            await asyncio.sleep(0.1)
            ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            if ok.status == 200:
                break
            assert ok.status == 429
        w.close()
        assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 2

    asyncio.run(_with_client(_served(max_concurrency=1, max_len=70000, body_timeout_s=0.3, write_timeout_s=0.5),
                             body))


def test_connections_past_the_limit_and_heads_that_trickle_are_closed_and_requests_go_on() -> None:
    """slowloris: more connections than the limit are closed at once; a connection that sends
    nothing, or trickles a head a byte at a time, first or after a kept-alive request, is
    closed at the heads' deadline; a request whose body follows its head is served, and so is
    one after all that."""
    import socket

    from aiohttp import web

    from testbed.serve.guard import serve_guarded

    async def main() -> None:
        gw = _Gateway()
        gw.release.set()
        runner = web.AppRunner(OpenAiFront(gw, _Tokenizer(), _served(), _Metrics()).app(),  # type: ignore[arg-type]
                               access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        server, stats = await serve_guarded(runner, sock, max_connections=8, head_timeout_s=0.5)
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode()

        async def answered(r: asyncio.StreamReader) -> bytes:
            got = b""
            async with asyncio.timeout(5):
                while b"completion_tokens" not in got:
                    part = await r.read(4096)
                    assert part, got
                    got += part
            return got

        try:
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
            for _ in range(100):  # (a loaded host: until the server has seen all twenty)
                if stats.refused + stats.open + stats.too_slow >= 20:
                    break
                await asyncio.sleep(0.02)
            assert stats.refused == 12
            for _ in range(100):  # past the deadline: the eight held are let go
                if stats.too_slow == 8 and all(r.at_eof() for r, _ in silent[:8]):
                    break
                await asyncio.sleep(0.05)
            assert stats.too_slow == 8 and stats.open == 0 and all(r.at_eof() for r, _ in silent[:8])
            # A kept-alive connection: one request served, then the next head trickled.
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(request)
            assert b"200 OK" in await answered(r)
            trickled = await asyncio.open_connection("127.0.0.1", port)
            for byte in request[:40]:
                for _, writer in ((r, w), trickled):
                    writer.write(bytes([byte]))
                await asyncio.sleep(0.05)
                if r.at_eof() and trickled[0].at_eof():
                    break
            for _ in range(100):
                if stats.too_slow == 10:
                    break
                await asyncio.sleep(0.05)
            assert stats.too_slow == 10, stats
            for _, writer in [*silent, (r, w), trickled]:
                writer.close()
            # And a request sent at once is served.
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(request)
            assert b"200 OK" in await answered(r)
            w.close()
        finally:
            server.close()
            await runner.cleanup()

    asyncio.run(main())
