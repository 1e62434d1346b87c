"""``testbed trace gen``: agentic sessions whose prefix-hit distribution follows a target.

Sessions are written at production lengths (contexts up to ``context_max`` tokens, outputs
of hundreds of tokens); ``--token-scale`` shrinks them at replay time. A session is

* a shared system/tool prompt (one of a small pool, so sessions reuse it across the trace),
* a first turn with the task (its hit is the shared prompt only: a low-hit request),
* follow-up turns, each appending the previous output and new input (tool results). For
  each follow-up the generator draws the hit rate it should have from the target
  distribution and sizes the new input so that, at block granularity, it has it,
* ended when its context would exceed ``context_max``.

Besides sessions, ``anomalous_share`` of all requests are "long input, low hit, short
output" requests (a large fresh document, a few dozen output tokens), flagged
``short_output``: the traffic PDD's filter is for.

The default target is the one reported for agentic traffic in ``docs/design.md``: mean hit
about 90 %, 70-80 % of requests above 95 %, 3-4 % anomalous requests. The generator solves
how many follow-ups land above 95 % from the expected share of first turns and anomalies;
``testbed trace stats`` on the output shows what it achieved.

Arrivals are closed loop by default (a follow-up is sent ``think`` seconds after the previous
answer ends, so a slow system is offered less load). ``arrivals="open"`` places every turn at
a fixed time instead: the previous turn's send time, plus the answer's nominal length
(``OPEN_TTFT_S`` plus ``open_tpot_s`` per output token), plus the think time. The offered load
then does not depend on how fast the system answers, which sweeps and capacity need; a turn
sent before its predecessor has finished finds less of its prefix cached, as it would in
production. ``rps`` sets the mean request rate instead of a session count: sessions are
drawn until ``duration_s``, each started after a gap whose mean is its own number of turns
over the rate (so requests, not sessions, arrive at ``rps``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.outputs import write_atomic
from testbed.traces import load_trace
from testbed.traces.formats import MOONCAKE_BLOCK, SESSIONS_FORMAT, sessions_workload
from testbed.traces.stats import format_stats, trace_stats
from testbed.traces.workload import Workload, block_hashes

RECIPE_GENERATOR = "testbed trace gen"  # a header with this generator holds a recipe to draw again
ARRIVALS = ("closed", "open")
OPEN_TTFT_S = 1.0  # open loop: a turn's answer is assumed to start this long after it is sent
# Where hits above 95 % fall (buckets of `trace stats`), relative weights.
HIGH_BUCKETS = [((0.95, 0.97), 0.30), ((0.97, 0.98), 0.25), ((0.98, 0.99), 0.25), ((0.99, 0.998), 0.20)]


@dataclass
class GenConfig:
    sessions: int = 60
    seed: int = 1
    duration_s: float = 120.0  # session starts are Poisson over this window
    above_95: float = 0.75  # target share of all requests with hit > 95 %
    anomalous_share: float = 0.035
    context_max: int = 65536
    turns_max: int = 14
    shared_prompts: int = 4
    think_mean_s: float = 2.0  # tool / user delay between turns (exponential)
    first_output_median: int = 800  # output tokens (lognormal); PDD's measurements use ~1K outputs
    output_median: int = 500
    shared_median: int = 24000  # system / tool prompt shared by sessions (tokens)
    block: int = MOONCAKE_BLOCK
    calibrate_scale: int = 1  # hit shares are calibrated as replayed with this --token-scale
    arrivals: str = "closed"  # "open": every turn at a fixed time (module docstring)
    rps: float | None = None  # mean requests per second over ``duration_s`` (replaces ``sessions``)
    open_tpot_s: float = 0.03  # open loop: nominal seconds per output token between a turn and the next
    outputs_cached: bool = False  # hits sized for a system that caches answers (workers.cache_outputs)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _target_hit(rng: random.Random, p_high: float) -> float:
    if rng.random() < p_high:
        r, acc = rng.random(), 0.0
        for (lo, hi), w in HIGH_BUCKETS:
            acc += w
            if r <= acc:
                return rng.uniform(lo, hi)
        return rng.uniform(*HIGH_BUCKETS[-1][0])
    return rng.uniform(0.90, 0.95)


def _new_tokens_for(hit: float, ctx_prev: int, out_prev: int, block: int, outputs_cached: bool = False) -> int:
    """New input so that the next prompt's block-granular hit is about ``hit`` (the previous
    answer counts as cached when the system caches answers)."""
    cached = ((ctx_prev + out_prev * outputs_cached) // block) * block
    want_total = cached / hit
    return max(1, round(want_total - ctx_prev - out_prev))


def generate(cfg: GenConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Sessions (as JSON-ready dicts) and the header line.

    Block granularity and turns whose previous output alone exceeds the drawn miss make the
    achieved share above 95 % differ from the drawn one, so the share of follow-ups drawn
    above 95 % is corrected a few times against the measured statistics (same seed, so only
    the hit draws change).
    """
    p_high: float | None = None
    best: tuple[float, list[dict[str, Any]], dict[str, Any]] | None = None
    for _ in range(12):
        sessions, header, p_used = draw_once(cfg, p_high)
        wl = sessions_workload(Path("<generated>"), enumerate(sessions, 2), cfg.calibrate_scale)
        stats = trace_stats(wl, outputs_cached=cfg.outputs_cached)
        err = stats.share_above_95 - cfg.above_95
        if best is None or abs(err) < best[0]:
            best = (abs(err), sessions, {**header, "achieved_above_95": round(stats.share_above_95, 4),
                                         "achieved_mean_hit": round(stats.mean_hit_rate, 4)})
        if abs(err) < 0.005:
            break
        p_high = min(1.0, max(0.0, p_used - err * 1.2))
    assert best is not None
    return best[1], best[2]


def draw_once(cfg: GenConfig, p_high: float | None) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    rng = random.Random(cfg.seed)
    shared = [(f"tools-{k}", _lognormal_int(rng, cfg.shared_median, 0.35, 4000, 48000))
              for k in range(cfg.shared_prompts)]
    # Plan session shapes first so the share of follow-ups above 95 % can be solved for.
    mean_turns = (cfg.turns_max + 3) / 2
    low_share = (1 - cfg.anomalous_share) / mean_turns + cfg.anomalous_share  # first turns + anomalies
    if p_high is None:
        p_high = min(1.0, cfg.above_95 / max(1e-9, 1 - low_share))
    hit_rng = random.Random(f"{cfg.seed}:hits")  # hit draws apart, so a corrected p_high changes only them
    out: list[dict[str, Any]] = []
    n_requests = 0
    if cfg.rps is None:
        starts: list[float] | None = sorted(rng.uniform(0, cfg.duration_s) for _ in range(cfg.sessions))
    else:
        starts, gap_rng, next_start = None, random.Random(f"{cfg.seed}:starts"), 0.0
        session_rps = cfg.rps * (1 - cfg.anomalous_share)
    s = 0
    while True:
        if starts is not None:
            if s == len(starts):
                break
            start = starts[s]
        else:
            start = next_start
            if start >= cfg.duration_s:
                break
        sid = f"s{s:04d}"
        s += 1
        pid, plen = rng.choice(shared)
        task = _lognormal_int(rng, 2500, 0.6, 200, 16000)
        turns: list[dict[str, Any]] = []
        ctx = plen + task
        first_out = _lognormal_int(rng, cfg.first_output_median, 0.5, 64, 4096)
        turns.append({"new_tokens": task, "output_tokens": first_out})
        out_prev = first_out
        at = 0.0
        n_turns = rng.randint(3, cfg.turns_max)
        for _ in range(1, n_turns):
            new = _new_tokens_for(_target_hit(hit_rng, p_high), ctx, out_prev, cfg.block, cfg.outputs_cached)
            if ctx + out_prev + new > cfg.context_max:
                break
            ctx += out_prev + new
            answer_s = OPEN_TTFT_S + cfg.open_tpot_s * out_prev  # the previous turn's, nominally
            out_prev = _lognormal_int(rng, cfg.output_median, 0.6, 32, 4096)
            think = rng.expovariate(1 / cfg.think_mean_s)
            at += answer_s + think
            turn: dict[str, Any] = {"new_tokens": new, "output_tokens": out_prev}
            if cfg.arrivals == "open":
                turn["at_s"] = round(at, 3)
            else:
                turn["delay_s"] = round(think, 3)
            turns.append(turn)
        out.append({"session": sid, "start_s": round(start, 3), "shared_prefix": {"id": pid, "tokens": plen},
                    "turns": turns})
        n_requests += len(turns)
        if starts is None:
            next_start = start + gap_rng.expovariate(session_rps / len(turns))
    # Anomalous requests: single-turn sessions of a large fresh document with a short answer.
    n_anom = round(cfg.anomalous_share * n_requests / (1 - cfg.anomalous_share))
    for k in range(n_anom):
        doc = _lognormal_int(rng, 32000, 0.3, 12000, cfg.context_max)
        out.append({"session": f"x{k:04d}", "start_s": round(rng.uniform(0, cfg.duration_s), 3),
                    "turns": [{"new_tokens": doc, "output_tokens": rng.randint(16, 64), "short_output": True,
                               "tag": "long-input-short-output"}]})
    out.sort(key=lambda d: d["start_s"])
    header = {"format": SESSIONS_FORMAT, "version": 1, "generator": RECIPE_GENERATOR, **cfg.as_dict()}
    return out, header, p_high


def same_recipe(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two trace headers from one recipe (they may differ in seed and in what was achieved)."""
    def key(m: dict[str, Any]) -> dict[str, Any]:  # a field an older header lacks has its default
        full = {**GenConfig().as_dict(), **m}
        return {k: v for k, v in full.items()
                if k not in ("seed", "format", "version") and not k.startswith("achieved_")}
    return a.get("generator") == RECIPE_GENERATOR and key(a) == key(b)


def write_jsonl(path: Path, records: list[dict[str, Any]], header: dict[str, Any] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ([json.dumps(header)] if header else []) + [json.dumps(s, separators=(",", ":")) for s in records]
    write_atomic(path, "\n".join(lines) + "\n")


def mooncake_lines(wl: Workload) -> list[dict[str, Any]]:
    """The workload as Mooncake records: timestamp (ms, estimated send time), lengths, and
    hash ids numbered by first appearance of each 512-token prefix block (chained, so equal
    ids mean an equal prefix up to and including that block); a partial last block gets
    an id of its own."""
    est = wl.first_sent()
    ids: dict[bytes, int] = {}
    out = []
    for r in sorted(wl.requests, key=lambda r: est[r.rid]):
        hashes = block_hashes(r.segments, MOONCAKE_BLOCK)
        hash_ids = [ids.setdefault(h, len(ids)) for h in hashes]
        if r.input_len % MOONCAKE_BLOCK:
            hash_ids.append(len(ids))
            ids[f"partial:{r.rid}".encode()] = len(ids)
        out.append({"timestamp": round(1000 * est[r.rid]), "input_length": r.input_len,
                    "output_length": r.output_len, "hash_ids": hash_ids})
    return out


def generate_file(cfg: GenConfig, output: Path, as_format: str = "sessions") -> str:
    """``testbed trace gen``: write the sessions (or Mooncake records) and return what to
    print: where it went and the statistics of what was written."""

    if not (0 <= cfg.above_95 <= 1 and 0 <= cfg.anomalous_share < 0.5 and cfg.sessions >= 1 and cfg.turns_max >= 3):
        raise InputError("trace gen: --above-95 must be in [0, 1], --anomalous in [0, 0.5), --sessions >= 1, "
                         "--turns-max >= 3")
    if cfg.arrivals not in ARRIVALS:
        raise InputError(f"trace gen: --arrivals must be one of {', '.join(ARRIVALS)}, got {cfg.arrivals!r}")
    if cfg.rps is not None and not (cfg.rps > 0 and cfg.duration_s > 0):
        raise InputError("trace gen: --rps and --duration must be > 0")
    if cfg.open_tpot_s < 0:
        raise InputError("trace gen: --open-tpot must be >= 0")
    sessions, header = generate(cfg)
    if as_format == "mooncake":
        # Mooncake has no sessions: closed-loop turns are placed at their estimated send time.
        write_jsonl(output, mooncake_lines(sessions_workload(output, enumerate(sessions, 2))))
    else:
        write_jsonl(output, sessions, header)
    return f"wrote {output} ({as_format}, seed {cfg.seed})\n" + format_stats(trace_stats(load_trace(output, as_format)))
