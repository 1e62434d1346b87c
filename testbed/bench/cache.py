"""Radix-cache eviction benchmark (issue #11): inserts into a full cache of 16K blocks.

``python -m testbed.bench.cache`` (``make bench-cache``) fills a ``RadixCache`` with
``blocks`` blocks of the default model's KV shape, then times inserts of new prompts that
each evict as many blocks as they add: the time of one insert of ``prompt_blocks`` blocks
(the bound in issue #11: 5 ms for a block's worth) and per block, as percentiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.radix_cache import RadixCache


def run(blocks: int = 16384, block_size: int = 16, prompt_blocks: int = 64, inserts: int = 200) -> dict[str, float]:
    c = RadixCache(block_size=block_size, capacity_tokens=block_size * blocks)
    n = block_size * prompt_blocks
    kv = torch.zeros(4, 2, 2, n, 64)  # the default model's layout: 4 layers, 2 KV heads, head dim 64
    for i in range(blocks // prompt_blocks):
        c.insert([i, *range(n - 1)], kv)
    times = []
    for i in range(inserts):
        t0 = time.perf_counter()
        c.insert([10**6 + i, *range(n - 1)], kv)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "blocks": float(c.blocks), "evicted_blocks": float(c.evicted_blocks),
        "insert_ms_p50": 1e3 * statistics.median(times), "insert_ms_p99": 1e3 * times[int(0.99 * (len(times) - 1))],
        "insert_ms_max": 1e3 * times[-1], "per_block_us_p50": 1e6 * statistics.median(times) / prompt_blocks,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m testbed.bench.cache", description=__doc__)
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--inserts", type=int, default=200)
    a = ap.parse_args()
    r = run(a.blocks, prompt_blocks=a.prompt_blocks, inserts=a.inserts)
    print(f"full cache of {r['blocks']:.0f} blocks, {a.inserts} inserts of {a.prompt_blocks} new blocks each "
          f"({r['evicted_blocks']:.0f} evicted): insert p50 {r['insert_ms_p50']:.2f} ms, p99 {r['insert_ms_p99']:.2f} "
          f"ms, max {r['insert_ms_max']:.2f} ms; {r['per_block_us_p50']:.1f} us per block (p50)")


if __name__ == "__main__":
    main()
