"""What the HTTP front end allows a connection before aiohttp parses it: a bounded number
open at once, and a deadline for a request's head.

aiohttp bounds a head's size and a body's arrival (``body_timeout_s``, ``app.py``) but not how
long a client may take to send the head itself, nor how many connections it may hold: a
client trickling one header byte a second on hundreds of connections (slowloris) kept every
one of them open. ``serve_guarded`` listens with aiohttp's protocol wrapped in ``_Guard``:

* past ``max_connections`` open, a new connection is closed at once (counted);
* a request's head (from its first byte to the blank line that ends it) must arrive within
  ``head_timeout_s`` (the first from the connection's opening), or the connection is closed
  (counted). ``_Guard`` follows the requests on a connection only as far as that needs: a
  head's end and its ``Content-Length``, so that a body's bytes are never read as a head. A
  chunked body ends the guard's part for that connection; a body's own arrival and the wait
  between requests are aiohttp's to time (``body_timeout_s``, its keep-alive timeout).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web

HEAD_END = b"\r\n\r\n"
MAX_HEAD = 1 << 16  # bytes of a head followed (aiohttp refuses longer header lines itself)
MAX_CONNECTIONS = 512
HEAD_TIMEOUT_S = 10.0


@dataclass
class GuardStats:
    open: int = 0
    refused: int = 0  # connections closed at once: the limit was reached
    too_slow: int = 0  # connections closed: no complete request head within the deadline


class _Guard(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the limit and the heads' deadline."""

    def __init__(self, inner: asyncio.Protocol, stats: GuardStats, max_connections: int,
                 head_timeout_s: float) -> None:
        self.inner, self.stats = inner, stats
        self.max_connections, self.head_timeout_s = max_connections, head_timeout_s
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.head = bytearray()  # the head in progress (its first MAX_HEAD bytes)
        self.body_left = 0  # bytes of the current request's body still to come
        self.following = True  # False once a chunked body makes a head's start unknowable here
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.stats.open >= self.max_connections:
            self.stats.refused += 1
            transport.abort()
            return
        self.stats.open += 1
        self.counted = True
        self._start_head()
        self.inner.connection_made(transport)

    def _start_head(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.head_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        self.timer = None
        self.stats.too_slow += 1
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.following:
            self._follow(data)
        self.inner.data_received(data)

    def _follow(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.following:
            if self.body_left:
                take = min(len(view), self.body_left)
                self.body_left -= take
                view = view[take:]
                continue
            if self.timer is None:  # the next request's head begins
                self._start_head()
            had = len(self.head)
            part = view[: MAX_HEAD - had]
            if not part:  # longer than any head aiohttp takes (it refused it): the deadline stands
                return
            self.head += part
            end = self.head.find(HEAD_END, max(0, had - 3))
            if end < 0:
                return
            consumed = end + len(HEAD_END) - had  # of this read's bytes, the head's
            head, self.head = bytes(self.head[:end]).lower(), bytearray()
            assert self.timer is not None
            self.timer.cancel()
            self.timer = None
            if b"\r\ntransfer-encoding:" in head:
                self.following = False
                return
            self.body_left = _content_length(head)
            view = view[consumed:]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.stats.open -= 1
            self.counted = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def __getattr__(self, name: str) -> Any:  # what aiohttp may ask of its own protocol
        return getattr(self.inner, name)


def _content_length(head: bytes) -> int:
    """A (lower-cased) head's ``Content-Length`` (0 when absent or not a number: aiohttp
    refuses such a request itself)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            value = value.strip()
            return int(value) if value.isdigit() and len(value) <= 18 else 0
    return 0


async def serve_guarded(runner: web.AppRunner, sock: socket.socket, max_connections: int = MAX_CONNECTIONS,
                        head_timeout_s: float = HEAD_TIMEOUT_S, backlog: int = 512) -> tuple[asyncio.Server,
                                                                                               GuardStats]:
    """Serve ``runner``'s application (set up) on the listening ``sock`` behind the guard."""
    server = runner.server
    assert server is not None, "the runner is not set up"
    stats = GuardStats()
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: _Guard(server(), stats, max_connections, head_timeout_s), sock=sock,
                                   backlog=backlog)
    return srv, stats
