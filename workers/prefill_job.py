"""A request in passes that pack several (``PrefillJob``): the prefill worker's with a token
budget (``workers/prefill.py``) and the colocated worker's mixed steps (``workers/colocated.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from protocol import clock
from protocol.messages import PrefillCmd
from workers import kv_stream
from workers.radix_cache import Node, RadixCache

Compute = asyncio.Future[tuple[tuple[torch.Tensor, int], float]]


def _retrieved(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


@dataclass(eq=False)
class PrefillJob:
    """A request's prefill in progress, one share of a pass at a time."""

    cmd: PrefillCmd
    path: list[Node]  # its cached prefix, locked until it ends
    hit: int
    compute: Compute  # the real model's, started at admission
    t0: float  # clock.now() at admission
    began: float  # clock.monotonic() at admission
    done: int = 0  # tokens after ``hit`` computed by the passes so far
    modeled: float = 0.0  # the modeled seconds of the passes it had a share of
    computed: kv_stream.Computed | None = None  # streamed: its passes as they end
    dropped: bool = False  # cancelled while in progress
    ended: bool = False  # its last pass is done and its end handled

    @property
    def left(self) -> int:
        return len(self.cmd.prompt) - self.hit - self.done

    def finish(self, cache: RadixCache) -> tuple[torch.Tensor, int, float]:
        """Its last pass ended: the real computation's KV cached under its prompt and its
        prefix unlocked; returns the KV, the first token and the computation's real seconds.
        Raises what the computation raised (the prefix unlocked all the same)."""
        try:
            (kv, first), real = self.compute.result()
            cache.insert(self.cmd.prompt, kv, self.path)
        finally:
            cache.unlock(self.path)
        return kv, first, real

    @classmethod
    def start(cls, cmd: PrefillCmd, cache: RadixCache,
              run: Callable[[list[int], list[torch.Tensor]], Awaitable[tuple[tuple[torch.Tensor, int], float]]],
              ) -> PrefillJob:
        """Its first share of a pass: its cached prefix matched and locked, its real
        computation (``run(prompt, cached blocks)``, on the compute thread) started."""
        path = cache.match_to_compute(cmd.prompt)
        cache.lock(path)
        compute = asyncio.ensure_future(run(cmd.prompt, cache.blocks_of(path)))
        compute.add_done_callback(_retrieved)  # a dropped job's failure is nobody's to read
        return cls(cmd, path, len(path) * cache.block_size, compute, clock.now(), clock.monotonic())
