"""``testbed verify``: every pipeline's greedy tokens must equal a single-process reference.

Relaying policies get a fixed eager-token budget per request (``EAGER_BUDGETS``), so the
relay -> main decoder handoff happens after 0, 1, 3, ... tokens for real instead of only
when the WAN happens to be fast enough.

Prompts share prefixes on purpose (groups with a common head), so prefix caches, partial
KV transfers and batching of different lengths are all exercised. The reference is
transformers ``generate(do_sample=False)`` on the same weights and dtype (float64 by
default: batching and chunking then cannot flip a greedy choice).
"""

from __future__ import annotations

import random
from typing import Any

from testbed.client import ClientRecord, RequestSpec
from testbed.traces.workload import synth_tokens

# Eager-token budgets given to the requests in turn: a relaying policy (pdd) hands each
# request over after exactly this many relay tokens, so every handoff count is exercised
# whatever the WAN's speed (other policies ignore it).
EAGER_BUDGETS = (0, 1, 3, 8, 15, 31, 63)


def verification_prompts(n: int = 24, seed: int = 7, max_len: int = 2048) -> list[RequestSpec]:
    """``n`` prompts of 16..max_len tokens in prefix-sharing groups, 1..64 output tokens,
    each with an eager-token budget for relaying policies."""
    rng = random.Random(seed)
    groups = [synth_tokens(f"verify-{seed}-{g}", rng.choice([16, 48, 256, max_len // 2])) for g in range(4)]
    specs = []
    lengths = [16, max_len] + [rng.randint(17, max_len) for _ in range(n - 2)]
    outs = [1, 64] + [rng.choice([1, 2, 7, 16, 33, 64]) for _ in range(n - 2)]
    for i in range(n):
        head = groups[i % len(groups)][: lengths[i] - 1]
        prompt = head + synth_tokens(f"verify-{seed}-tail-{i}", lengths[i] - len(head))
        specs.append(RequestSpec(f"v{i:03d}", prompt, outs[i], at=0.05 * i,
                                 meta={"eager": EAGER_BUDGETS[i % len(EAGER_BUDGETS)]}))
    return specs


def compare(specs: list[RequestSpec], refs: dict[str, list[int]], recs: dict[str, ClientRecord]
            ) -> list[dict[str, Any]]:
    """One row per mismatching or failed request (empty = all equal)."""
    bad = []
    for s in specs:
        r = recs[s.rid]
        if not r.ok:
            bad.append({"rid": s.rid, "problem": f"failed: {r.error}"})
        elif r.tokens != refs[s.rid]:
            at = next((i for i, (a, b) in enumerate(zip(r.tokens, refs[s.rid], strict=False)) if a != b),
                      min(len(r.tokens), len(refs[s.rid])))
            bad.append({"rid": s.rid, "problem": f"token {at} differs (got {r.tokens[at:at + 3]}, "
                        f"reference {refs[s.rid][at:at + 3]}; lengths {len(r.tokens)}/{len(refs[s.rid])})"})
    return bad
