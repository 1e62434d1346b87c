"""Point-to-point TCP transfer of KV between workers (the format: ``protocol/kv_format.py``).

``send_kv`` sends what the receiver lacks, block by block; ``serve_kv`` / ``receive_kv``
(``workers/kv_receive.py``) take transfers. The receiver trusts nothing its peer sends: every frame's length is capped
before it is read (control frames ``MAX_CONTROL_FRAME``, HELLO ``MAX_HELLO``, a BLOCK at
most the KV still missing), HELLO is a validated ``Hello`` (request id alphabet, at most
``MAX_PROMPT_TOKENS`` token ids, a dtype from a whitelist, the run's KV token, the request's
ticket) whose layout must equal the receiver's own model (``ModelShape``), and every block is verified
(checksum, shape, dtype, length, contiguity) before it is used. Anything else ends that
transfer with a reason on both sides (``fail``); the server serves on. ``cancel`` cuts a
transfer off at once, even mid-block (a reset, SO_LINGER 0: bytes still queued in the
sender's socket buffer are discarded, not sent); the kernel's ``tcp_info`` says what the
receiver got and what was still in flight. PDD cuts off useless WAN transfers this way.

A connection opens with AUTH, the run's KV token alone (``MAX_AUTH`` bytes at most, within
``AUTH_TIMEOUT_S``): ``serve_kv`` refuses and closes anything else before it reads a HELLO
(up to ``MAX_HELLO``, megabytes) or serves a transfer, so a stranger on the emulated network
can neither make a receiver read much nor hold its connection slots for long.

Nothing waits forever on a peer (``timeout_s``, emulated seconds stretched by the dilation,
like every time a worker is given): within a transfer every read and every write that
drains the socket must make progress within it, the kernel gives up on data the peer does
not acknowledge (``TCP_USER_TIMEOUT``) and probes an idle connection (keepalive) on both
sides, so a peer that vanished, or a reset lost on a line that was down, ends the transfer
and frees its buffer. A receiver closes a kept connection idle for ``IDLE_FACTOR`` x that
long and serves at most ``MAX_CONNECTIONS`` at once (more are told so and closed); of those
still to send their AUTH it keeps ``MAX_UNAUTHENTICATED``, closing the oldest for a new one.

Connections persist (``Connections``, ``workers/kv_conn.py`` says why): a connection is reused
only after a transfer that ended cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol import clock
from protocol.kv_format import (  # noqa: F401 - the format's names are part of this module's interface
    ACK,
    AUTH,
    AUTH_TIMEOUT_S,
    BLOCK,
    BLOCK_HDR,
    CODE_DTYPES,
    DTYPE_CODES,
    DTYPE_NAMES,
    END,
    EXTEND,
    FRAME_TOKENS,
    HDR,
    HELLO,
    JOIN,
    MAGIC,
    MAX_AUTH,
    MAX_CONTROL_FRAME,
    MAX_HELLO,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    OFFER,
    STATE,
    STATE_FRAME,
    VERSION,
    Ack,
    Auth,
    Block,
    End,
    Hello,
    Join,
    KVRefused,
    KVTransferError,
    ModelShape,
    Offer,
    check_block,
    decode_block,
    encode_block,
    encode_zero_block,
    layer_bounds,
    parse_frame,
    recv_frame,
    send_frame,
)
from workers import kv_stream, kv_stripes
from workers.kv_conn import (  # noqa: F401 - Connections and the limits are part of this module's interface
    IDLE_FACTOR,
    MAX_CONNECTIONS,
    MAX_UNAUTHENTICATED,
    Admission,
    Conn,
    Connections,
    PeerSilent,
    authenticate,
    bytes_acked,
    bytes_put_out,
    connect,
    listen,
    open_authenticated,
    read_frame,
    tune_socket,
    write_frame,
)
from workers.kv_receive import DoneFn, FailFn, Incoming, OfferFn, receive_kv, serve_kv  # noqa: F401 - its interface
from workers.kv_stream import Computed


@dataclass
class TransferStats:
    request_id: str
    peer: str
    start: float
    end: float = 0.0
    bytes_sent: int = 0
    payload_bytes: int = 0
    tokens_sent: int = 0
    receiver_had: int = 0
    cancelled: bool = False
    bytes_acked: int = 0  # what the receiver's TCP acknowledged (all of bytes_sent unless cut off)
    bytes_in_flight: int = 0  # cut off: put out and not acknowledged at the cut, up to the reset (may still cross)
    planned_payload: int = 0  # payload bytes the receiver lacked (what a full transfer sends)
    error: str | None = None


@functools.cache
def _state_zeros(size: int) -> bytes:
    """A state frame's payload: the small real model has no such state; zeros stand in."""
    return bytes(size)


class _StaleConnection(Exception):
    """A reused connection was dead before the receiver answered HELLO."""


async def send_kv(
    host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor, first_token: int,
    block_size: int, cancel: asyncio.Event | None = None, corrupt_block: int | None = None,
    on_progress: Callable[[TransferStats], None] | None = None, frame_tokens: int = 0, token: str = "",
    ticket: str = "", pool: Connections | None = None, zeros: bool = False, netns: str | None = None,
    timeout_s: float | None = None, state_bytes: int = 0, computed: Computed | None = None, connections: int = 1,
    layer_groups: int = 1,
) -> TransferStats:
    """Send the part of ``kv`` (for ``tokens``) the receiver lacks, in frames of whole blocks
    (``frame_tokens``, default ``FRAME_TOKENS``), over a connection from ``pool`` if it has
    one (and back into it afterwards). ``zeros``: the KV is a modeled worker's, all zeros
    (its frames are built from cached payloads); ``netns``: the sender's namespace, when its
    process stands for several hosts; ``timeout_s``: how long the receiver may take nothing
    (or answer nothing) before the transfer is broken; ``ticket``: the request's ticket for
    this receiver (``KVTarget.ticket``); ``state_bytes``: the request's fixed-size state sent
    after the KV (STATE frames, ``protocol.kv_format``); ``computed``: KV streamed as it is
    computed, each frame sent once its tokens are (``workers.kv_stream``); ``connections``: at
    most this many TCP connections carry the frames (``workers.kv_stripes``, where the receiver
    takes several); ``layer_groups``: a streamed transfer's blocks each carry one of this
    many groups of layers, sent as the pass computes them (``kv_stream.LayerOrder``). Raises
    KVTransferError."""
    if pool is not None and (conn := pool.take(host, port)) is not None:
        try:
            return await _send(conn, host, port, request_id, tokens, kv, first_token, block_size, cancel,
                               corrupt_block, on_progress, frame_tokens, token, ticket, pool, zeros, True, timeout_s,
                               state_bytes=state_bytes, computed=computed, connections=connections, netns=netns,
                               layer_groups=layer_groups)
        except _StaleConnection:
            pass  # the receiver closed it while idle: one fresh connection
    conn, auth = await open_authenticated(host, port, netns, timeout_s, token)
    try:
        return await _send(conn, host, port, request_id, tokens, kv, first_token, block_size, cancel, corrupt_block,
                           on_progress, frame_tokens, token, ticket, pool, zeros, False, timeout_s, auth,
                           state_bytes=state_bytes, computed=computed, connections=connections, netns=netns,
                           layer_groups=layer_groups)
    except _StaleConnection as e:  # not reused: a plain broken transfer
        raise KVTransferError(f"transfer to {host}:{port} broke: {e}") from e


async def _send(
    conn: Conn, host: str, port: int, request_id: str, tokens: list[int], kv: torch.Tensor, first_token: int,
    block_size: int, cancel: asyncio.Event | None, corrupt_block: int | None,
    on_progress: Callable[[TransferStats], None] | None, frame_tokens: int, token: str, ticket: str,
    pool: Connections | None, zeros: bool, reused: bool, timeout_s: float | None, preamble: int = 0,
    state_bytes: int = 0, computed: Computed | None = None, connections: int = 1, netns: str | None = None,
    layer_groups: int = 1,
) -> TransferStats:
    # The sender's event loop runs beside a compute thread that needs the GIL after every
    # torch op: Python work per frame is time taken from a paced step (see FRAME_TOKENS).
    per_frame = max(block_size, (frame_tokens or FRAME_TOKENS) // block_size * block_size)
    st = TransferStats(request_id, f"{host}:{port}", clock.now(), bytes_sent=preamble)  # its AUTH, if fresh
    layers, _, heads, n, head_dim = kv.shape
    groups = max(1, min(layer_groups, layers)) if computed is not None else 1  # per layer: streamed only
    bounds = layer_bounds(layers, groups)
    reader, writer = conn
    # Every connection of the transfer: (writer, socket, what its kernel had acknowledged
    # before). A kept connection has carried earlier transfers: this one's share starts here.
    # (Taken whole, a cut-off on a reused connection reported every earlier transfer's bytes
    # as its own: more than it wrote, a WAN "faster" than its line.)
    sock = writer.get_extra_info("socket")
    conns: list[tuple[asyncio.StreamWriter, socket.socket, int]] = [(writer, sock, bytes_acked(sock))]
    sides: list[Conn] = []
    clean = False

    async def cut_off() -> None:
        assert cancel is not None
        await cancel.wait()
        st.cancelled = True
        at_cut = list(conns)  # a connection still opening is reset below, having sent nothing counted
        acked = [bytes_acked(s) for _, s, _ in at_cut]
        st.bytes_acked = min(st.bytes_sent, sum(max(0, a - b) for a, (_, _, b) in zip(acked, at_cut, strict=True)))

        # Until the reset (abort closes the socket a turn later), the kernel keeps sending as
        # acknowledgements come: all it put out unacknowledged at the cut may still cross.
        def flown() -> None:
            outs = [bytes_put_out(s) for _, s, _ in at_cut]
            if any(o is None for o in outs):
                st.bytes_in_flight = st.bytes_sent - st.bytes_acked
            else:
                st.bytes_in_flight = sum(max(0, o - a) for o, a in zip(outs, acked, strict=True))  # type: ignore[operator]

        asyncio.get_running_loop().call_soon(flown)
        for w, s, _ in at_cut:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()  # RST: queued bytes are dropped, not sent

    async def frames(w: asyncio.StreamWriter, s: int) -> bool:
        """Send stripe ``s``'s frames (``j = s, s + k, ...`` of the transfer's) on ``w``, each
        once its KV is computed; False if cut off."""
        stops = [cancel] if cancel else []
        j = s
        while True:
            if order is None:
                if j >= len(starts):
                    break
                g, start = 0, starts[j]
            elif (frame := await order.get(j, stops)) is not None:
                g, start = frame
            else:
                break
            if computed is not None and not await computed.until(min(n, start + per_frame), stops, g, groups):
                if watcher is not None:
                    await watcher  # cut off while its tokens were computed: counted, the connections reset
                return False
            if st.cancelled:
                return False
            part = kv[bounds[g] : bounds[g + 1], :, :, start : start + per_frame]
            # Fault injection names a block; its frame (its first layer group's) is the one corrupted.
            hit = corrupt_block is not None and g == 0 and start <= corrupt_block * block_size < start + per_frame
            frame, nbytes = (encode_zero_block if zeros else encode_block)(j, start, part, hit, bounds[g])
            await _write(st, w, BLOCK, frame, timeout_s)
            st.payload_bytes += nbytes
            if g == groups - 1:  # a token is sent once its last layer group is
                st.tokens_sent += part.shape[3]
            if on_progress:
                on_progress(st)
            await asyncio.sleep(0)  # drain() returns at once below the buffer's mark: yield (see the receiver)
            j += k
        return not st.cancelled

    async def ended(side: Conn, end: bytes) -> None:
        await _write(st, side[1], END, end, timeout_s)
        ftype, payload = await read_frame(side[0], timeout_s=timeout_s)
        ack = parse_frame(Ack, payload, "ACK")
        if ftype != ACK or not ack.ok:
            raise KVTransferError(f"receiver rejected the transfer: {ack.error or f'frame type {ftype}'}")

    watcher = asyncio.create_task(cut_off()) if cancel is not None else None
    try:
        hello = Hello(rid=request_id, tokens=tokens, dtype=str(kv.dtype), layers=layers,  # type: ignore[arg-type]
                      kv_heads=heads, head_dim=head_dim, block_size=block_size, token=token, ticket=ticket,
                      state_bytes=state_bytes, stripes=connections, layer_groups=groups)
        try:
            await _write(st, writer, HELLO, hello.wire(), timeout_s)
            ftype, payload = await read_frame(reader, timeout_s=timeout_s)
        except (OSError, asyncio.IncompleteReadError) as e:
            if reused and not st.cancelled:
                raise _StaleConnection(str(e)) from e
            raise
        if ftype == ACK:  # refused before any offer (a bad HELLO): the receiver says why
            raise KVTransferError(f"receiver refused: {parse_frame(Ack, payload, 'ACK').error}")
        offer = parse_frame(Offer, payload, "OFFER")
        if ftype != OFFER or offer.error is not None or offer.have is None:
            raise KVTransferError(f"receiver refused: {offer.error or f'frame type {ftype}'}")
        if offer.have > n or offer.have % block_size:
            raise KVTransferError(f"receiver offered {offer.have} cached tokens of {n} (block {block_size})")
        have = offer.have
        st.receiver_had = have
        st.planned_payload = (n - have) * kv[:, :, :, :1].numel() * kv.element_size() + state_bytes
        starts = list(range(have, n, per_frame))
        # Per layer: frames of one layer group each, in the order they are computed.
        order = kv_stream.LayerOrder(computed, have, n, per_frame, groups) if groups > 1 and computed else None
        # Frame j on stripe j % k: the further connections the receiver allowed (its key), one
        # per frame at most, all joined before any block is sent (below).
        k = max(1, min(connections, len(starts) * groups)) if offer.key is not None else 1
        end = End(first_token=first_token, n=n).model_dump_json().encode()

        async def join(i: int) -> None:
            c, opened = await kv_stripes.open_side(host, port, offer.key or "", i, token, pool, netns, timeout_s)
            sides.append(c)
            conns.append((c[1], c[1].get_extra_info("socket"), bytes_acked(c[1].get_extra_info("socket"))))
            st.bytes_sent += opened

        async def side(i: int) -> None:
            c = sides[i - 1]
            if await frames(c[1], i):
                await ended(c, end)

        async def own() -> None:
            if await frames(writer, 0):
                for off in range(0, state_bytes, STATE_FRAME):
                    if st.cancelled:
                        break
                    size = min(STATE_FRAME, state_bytes - off)
                    await _write(st, writer, STATE, _state_zeros(size), timeout_s)
                    st.payload_bytes += size
                    await asyncio.sleep(0)

        if k == 1:
            await own()
        else:
            # Every further connection joined before the first sends a block: a JOIN sent
            # later would queue behind this transfer's own frames at the line's buffer.
            await kv_stripes.together([join(i) for i in range(1, k)])
            if not st.cancelled:
                await kv_stripes.together([own(), *(side(i) for i in range(1, k))])
        if not st.cancelled:
            await ended(conn, end)
            st.bytes_acked = st.bytes_sent
            clean = True
    except (OSError, asyncio.IncompleteReadError) as e:
        if not st.cancelled:
            raise KVTransferError(f"transfer to {host}:{port} broke: {e}") from e
    except KVTransferError:
        if not st.cancelled:
            raise
    finally:
        st.end = clock.now()
        if watcher is not None:
            watcher.cancel()
        for c in (conn, *sides):
            if clean and not st.cancelled and pool is not None:
                pool.give_back(host, port, c)
            else:
                c[1].close()
                with contextlib.suppress(OSError):
                    await c[1].wait_closed()
    return st


async def _write(st: TransferStats, writer: asyncio.StreamWriter, ftype: int, payload: bytes,
                 timeout_s: float | None) -> None:
    """One frame, counted when handed over: a cut-off mid-frame then clips none of what was acknowledged."""
    st.bytes_sent += HDR.size + len(payload)
    await write_frame(writer, ftype, payload, timeout_s)

