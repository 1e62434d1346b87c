"""A KV transfer's data phase over the link model, on one connection or several
(``kv_connections``; the wire's: ``workers/kv_stripes.py``), after the prefill, per chunk or
per layer group (``workers/kv_stream.py``).

Frame ``j`` of a transfer travels on connection ``j % k``, as ``kv_wire._send`` spreads them;
each connection is a flow of its own on every link it crosses, with its own window, so a
transfer over ``k`` takes up to ``k`` shares of a contended line. A further connection is a
kept one of the same pair of hosts when one is free, else a new one; it opens with AUTH (new
only) and JOIN and waits for the receiver's answer (a round trip), and all of them have joined
before the first connection sends a block, as on the wire. The first connection carries its
frames, the request's state and the END; each further one its frames and an END of its own.
Bytes are the wire's, frame for frame.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from protocol import clock
from protocol.kv_format import BLOCK_HDR, FRAME_TOKENS, HDR, Auth, Join, layer_bounds
from testbed.sim.links import Conn, Origin
from testbed.sim.network import LinkModel
from workers.kv_stream import DUE_EPS_S, Computed, LayerOrder
from workers.kv_stripes import together


def per_frame(block_size: int, frame_tokens: int = 0) -> int:
    """Tokens a BLOCK frame carries (the last may carry fewer): ``kv_wire._send``'s framing."""
    return max(block_size, (frame_tokens or FRAME_TOKENS) // block_size * block_size)


def frames_of(have: int, n: int, per_token: int, block_size: int, frame_tokens: int = 0) -> list[tuple[int, int]]:
    """(last token + 1, bytes) of each BLOCK frame carrying tokens ``[have, n)`` (``kv_wire._send``'s framing)."""
    pf = per_frame(block_size, frame_tokens)
    return [(min(n, s + pf), HDR.size + BLOCK_HDR.size + (min(n, s + pf) - s) * per_token) for s in range(have, n, pf)]


def layer_sizes(per_layer: int, layers: int, groups: int, n: int, block_size: int,
                frame_tokens: int = 0) -> Callable[[tuple[int, int]], int]:
    """A per-layer frame's bytes, (layer group, first token) -> header and its group's KV of
    its tokens (``per_layer``: one layer's KV bytes per token)."""
    bounds, pf = layer_bounds(layers, groups), per_frame(block_size, frame_tokens)

    def size(f: tuple[int, int]) -> int:
        g, start = f
        return HDR.size + BLOCK_HDR.size + (min(n, start + pf) - start) * per_layer * (bounds[g + 1] - bounds[g])

    return size


async def stream(links: LinkModel, conn: Conn, computed: Computed | None, frames: Sequence[tuple[int, int]],
                 tail: int, stops: list[asyncio.Event], timeout_s: float | None) -> float:
    """Push ``frames`` then ``tail`` bytes on ``conn``; streamed (``computed``), each burst
    carries the frames whose tokens are all computed by then (``kv_wire._send`` waits before
    each frame alike), the last one the rest; one flow's identity throughout, its window kept
    between bursts (the emulation's namespaces keep a window after idle). Bytes sent."""
    total = sum(b for _, b in frames) + tail
    if computed is None:
        return await links.send(conn, total, stops, timeout_s)
    origin = Origin()
    pushed = sent = 0.0
    upto = 0
    i = 0
    while i < len(frames) or pushed < total:
        if i < len(frames):
            if not await computed.until(frames[i][0], stops):
                break
            now = clock.monotonic()
            upto += frames[i][1]
            i += 1  # due (woken at its time, to the float's rounding), and any due by then
            while i < len(frames) and computed.ready(now) >= frames[i][0]:
                upto += frames[i][1]
                i += 1
        top = total if i == len(frames) else upto
        sent += await links.send(conn, top - pushed, stops, timeout_s, origin)
        pushed = top
        if any(ev.is_set() for ev in stops):
            break
    return sent


async def stream_layers(links: LinkModel, conn: Conn, order: LayerOrder, s: int, k: int,
                        size: Callable[[tuple[int, int]], int], tail: int, stops: list[asyncio.Event],
                        timeout_s: float | None) -> float:
    """``stream`` for a per-layer transfer: connection ``s`` of ``k`` pushes frames ``j = s, s +
    k, ...`` of ``order`` (``kv_stream.LayerOrder``), each burst the frames due by then, the
    last with ``tail``; ``size``: a frame's bytes. Bytes sent."""
    origin = Origin()
    sent = 0.0
    j = s
    while (frame := await order.get(j, stops)) is not None:
        if not await order.ready(frame, stops):
            return sent
        now = clock.monotonic()
        burst, j = size(frame), j + k
        while j < len(order.frames) and (due := order.due(order.frames[j])) is not None and due <= now + DUE_EPS_S:
            burst, j = burst + size(order.frames[j]), j + k
        sent += await links.send(conn, burst + (tail if order.last(j) else 0), stops, timeout_s, origin)
        if any(ev.is_set() for ev in stops) or order.last(j):
            return sent
    if not any(ev.is_set() for ev in stops):  # a connection with no frame of its own
        sent += await links.send(conn, tail, stops, timeout_s, origin)
    return sent


async def send_striped(links: LinkModel, conn: Conn, free: Callable[[], Conn], k: int, token: str,
                       computed: Computed | None, frames: list[tuple[int, int]], tail: int, end: int,
                       stops: list[asyncio.Event], timeout_s: float | None, sides: list[Conn],
                       connect: Callable[[Conn], asyncio.Future[None]], order: LayerOrder | None = None,
                       size: Callable[[tuple[int, int]], int] = lambda f: 0) -> float:
    """The data phase over ``conn`` and ``k - 1`` further connections (``free()`` gives one,
    ``connect`` waits for its path; each is added to ``sides`` at once, for the caller to
    release or reset): frame ``j`` on connection ``j % k``, ``tail`` (state, END) on the first,
    an END of ``end`` bytes on each further one; per layer, frame ``j`` of ``order`` (``size``:
    its bytes). Bytes sent, openings included."""

    async def join(i: int) -> float:
        c = free()
        sides.append(c)
        fresh = not c.established
        if fresh:
            await connect(c)
        await asyncio.sleep(links.prepare(c))
        opened = HDR.size + len(Join(key="0" * 32, stripe=i).model_dump_json())
        if fresh:  # a connection's first frame is its AUTH
            opened += HDR.size + len(Auth(token=token).model_dump_json())
        sent = await links.send(c, opened, stops, timeout_s)
        if not any(ev.is_set() for ev in stops):
            await asyncio.sleep(answer)
        return sent

    # The JOINs' way there and their answers' back, with the standing queue other traffic keeps
    # on the line now: taken before the JOINs' own few bytes count as filling it.
    answer = links.latency(conn.path.links) + links.latency(conn.path.back)
    # Every further connection joined before the first sends a block (kv_wire._send).
    sent = sum(await together([join(i) for i in range(1, k)]))
    if any(ev.is_set() for ev in stops):
        return sent
    conns = [conn, *sides]
    if order is not None:
        return sent + sum(await together([stream_layers(links, c, order, i, k, size, tail if i == 0 else end, stops,
                                                        timeout_s) for i, c in enumerate(conns)]))
    return sent + sum(await together([stream(links, c, computed, frames[i::k], tail if i == 0 else end, stops,
                                             timeout_s) for i, c in enumerate(conns)]))
