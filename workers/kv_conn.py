"""The KV wire's connections: frames in and out with time limits, socket options that let
the kernel end a connection whose peer is gone, and the pool of kept connections (the
transfers themselves: ``workers/kv_wire.py``).

Connections persist (``Connections``): a sender keeps its connection to each receiver open
between transfers and the receiver serves transfer after transfer on it, as a transfer
engine's connection would. A fresh TCP connection per transfer costs a handshake and a slow
start from ten segments every time: a 200-token transfer over an idle 60 ms line took
1.56 s emulated instead of ~0.13 s. A connection is reused only after a transfer that
ended cleanly; a cut-off or broken one is closed, and a reused connection found dead before
the receiver's OFFER is replaced once by a fresh one."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import struct
from collections.abc import Awaitable, Callable

from protocol.kv_format import (
    ACK,
    AUTH,
    AUTH_TIMEOUT_S,
    HDR,
    MAGIC,
    MAX_AUTH,
    MAX_CONTROL_FRAME,
    VERSION,
    Ack,
    Auth,
    KVTransferError,
    parse_frame,
)
from protocol.refusals import refusal
from workers.namespace import tcp_socket

MAX_CONNECTIONS = 256  # a receiver's authenticated connections (senders keep kv_streams_per_peer each)
# Connections that have not yet sent their AUTH: a few, and the oldest is closed to make room
# for a new one (a sender of the run authenticates at once; 300 silent connections once held
# every slot of a receiver for AUTH_TIMEOUT_S, and again whenever they reconnected).
MAX_UNAUTHENTICATED = 16
IDLE_FACTOR = 5  # a kept connection idle for IDLE_FACTOR x the timeout is closed by the receiver
# Connections a listener lets wait for their accept: transfers to one decoder may each open up to
# MAX_KV_CONNECTIONS at once (``kv_connections``), and a SYN past a full backlog waits a second for
# its retransmission (asyncio's default is 100; the bench's line with a backlog of 128: 160
# connections at once took 8.0 s, 7.3 s with room for all).
LISTEN_BACKLOG = 1024


class PeerSilent(KVTransferError):
    """The peer sent nothing within the timeout."""


async def write_frame(w: asyncio.StreamWriter, ftype: int, payload: bytes, timeout_s: float | None = None) -> int:
    w.write(HDR.pack(MAGIC, VERSION, ftype, 0, len(payload)))
    w.write(payload)
    try:
        async with asyncio.timeout(timeout_s):
            await w.drain()
    except TimeoutError as e:
        raise KVTransferError(f"the peer took nothing for {timeout_s:g} s") from e
    return HDR.size + len(payload)


async def read_frame(r: asyncio.StreamReader, max_len: int = MAX_CONTROL_FRAME,
                timeout_s: float | None = None) -> tuple[int, bytes]:
    """One frame; its announced length is checked against ``max_len`` before anything is read."""
    try:
        async with asyncio.timeout(timeout_s):
            hdr = await r.readexactly(HDR.size)
            magic, ver, ftype, _, n = HDR.unpack(hdr)
            if magic != MAGIC or ver != VERSION:
                raise KVTransferError(f"bad frame header {hdr[:8]!r}")
            if n > max_len:
                raise KVTransferError(f"frame type {ftype} announces {n} bytes (at most {max_len} expected)")
            return ftype, await r.readexactly(n)
    except TimeoutError as e:
        raise PeerSilent(f"nothing from the peer for {timeout_s:g} s") from e


def tune_socket(sock: socket.socket | None, timeout_s: float | None) -> None:
    """Keepalive probes on an idle connection and a bound on unacknowledged data, both within
    ``timeout_s``: the kernel ends a connection whose peer is gone."""
    if sock is None or timeout_s is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(timeout_s / 4)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(timeout_s / 8)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(timeout_s * 1000)))


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Connections:
    """Idle connections to receivers, by address; a connection is out of the pool while a
    transfer uses it, so it carries one transfer at a time."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Conn]] = {}

    def take(self, host: str, port: int) -> Conn | None:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn[1].is_closing() and not conn[0].at_eof():
                return conn
            conn[1].close()
        return None

    def give_back(self, host: str, port: int, conn: Conn) -> None:
        self._idle.setdefault((host, port), []).append(conn)

    def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()


async def connect(host: str, port: int, netns: str | None) -> Conn:
    if netns is None:
        return await asyncio.open_connection(host, port)
    sock = tcp_socket(netns)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def open_authenticated(host: str, port: int, netns: str | None, timeout_s: float | None,
                             token: str) -> tuple[Conn, int]:
    """A new connection to a receiver, tuned, its AUTH sent: (connection, the AUTH's bytes).
    Raises KVTransferError."""
    try:
        async with asyncio.timeout(timeout_s):
            conn = await connect(host, port, netns)
    except (OSError, TimeoutError) as e:
        raise KVTransferError(f"connect to {host}:{port}: {e or 'timed out'}") from e
    tune_socket(conn[1].get_extra_info("socket"), timeout_s)
    try:  # a connection's first frame: the run's token, alone (the receiver reads nothing else first)
        return conn, await write_frame(conn[1], AUTH, Auth(token=token).model_dump_json().encode(), timeout_s)
    except (OSError, KVTransferError) as e:
        conn[1].close()
        raise KVTransferError(f"transfer to {host}:{port} broke: {e}") from e


def bytes_acked(sock: socket.socket) -> int:
    """tcp_info.tcpi_bytes_acked (Linux >= 4.1): bytes the peer acknowledged."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return 0
    return int(struct.unpack_from("Q", info, 120)[0])


def bytes_put_out(sock: socket.socket) -> int | None:
    """Bytes sent onto the network over the connection's life, each once (tcp_info's
    tcpi_bytes_sent less tcpi_bytes_retrans: Linux >= 4.19); None where the kernel does not
    say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < 216:
        return None
    sent, resent = (struct.unpack_from("Q", info, o)[0] for o in (200, 208))
    return int(sent - resent)


async def serve_liveness(host: str, port: int, netns: str | None) -> asyncio.Server:
    """A listener that only says this process is alive (a worker without a KV server of its
    own: a prefill): the router's probe connects, a dead process's host refuses."""

    async def close(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    return await listen(close, host, port, netns)


async def listen(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]], host: str,
                 port: int, netns: str | None) -> asyncio.Server:
    """A TCP server on ``host:port``, inside ``netns`` when given (a process standing for
    several hosts opens each host's socket in that host's namespace)."""
    if netns is None:
        return await asyncio.start_server(handle, host, port, backlog=LISTEN_BACKLOG)
    sock = tcp_socket(netns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return await asyncio.start_server(handle, sock=sock, backlog=LISTEN_BACKLOG)


async def authenticate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str,
                         timeout_s: float | None) -> bool:
    """A connection's first frame must be AUTH with the run's token: at most ``MAX_AUTH``
    bytes within ``AUTH_TIMEOUT_S`` (or the transfer timeout, if shorter). A stranger is told
    why and closed before it can make the receiver read a HELLO or hold a connection slot."""
    wait = AUTH_TIMEOUT_S if timeout_s is None else min(AUTH_TIMEOUT_S, timeout_s)
    try:
        ftype, payload = await read_frame(reader, MAX_AUTH, wait)
        if ftype != AUTH:
            raise KVTransferError(f"the first frame is type {ftype}, not AUTH")
        auth = parse_frame(Auth, payload, "AUTH")
        if token and not hmac.compare_digest(auth.token.encode(), token.encode()):
            raise KVTransferError("AUTH without this run's KV token")
        return True
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return False  # connected and left without a word (a port scan, a liveness check)
        why = f"cut off mid-frame ({len(e.partial)} bytes)"
    except Exception as e:  # noqa: BLE001 - a stranger is refused, never the server
        why = str(e) or type(e).__name__
    peer = writer.get_extra_info("peername")
    refusal(f"KV: refused a connection from {peer}: {why}")
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await write_frame(writer, ACK, Ack(error=f"refused: {why}").model_dump_json().encode())
    return False


class Admission:
    """Who a receiver serves: connections that sent the run's AUTH, ``max_connections`` at
    once (more are told so and closed), and meanwhile ``MAX_UNAUTHENTICATED`` still to send
    it, the oldest of those closed to make room for a new one."""

    def __init__(self, max_connections: int, token: str, timeout_s: float | None) -> None:
        self.max_connections, self.token, self.timeout_s = max_connections, token, timeout_s
        self.open = 0
        self.unauthenticated: dict[asyncio.StreamWriter, None] = {}  # oldest first

    async def admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """True: the connection holds a slot until ``release``; False: it was closed."""
        if len(self.unauthenticated) >= MAX_UNAUTHENTICATED:
            oldest = next(iter(self.unauthenticated))
            self.unauthenticated.pop(oldest)
            oldest.transport.abort()  # its AUTH read ends at once
        self.unauthenticated[writer] = None
        tune_socket(writer.get_extra_info("socket"), self.timeout_s)
        try:
            authenticated = await authenticate(reader, writer, self.token, self.timeout_s)
        finally:
            self.unauthenticated.pop(writer, None)
        if authenticated and self.open >= self.max_connections:
            with contextlib.suppress(Exception):
                refusal = Ack(error=f"{self.max_connections} connections already open")
                await write_frame(writer, ACK, refusal.model_dump_json().encode(), self.timeout_s)
            authenticated = False
        if not authenticated:
            writer.close()
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1
