"""PDD: prefill (P) and relay decode (RLD) in the prefill's datacenter, main decode (MD) across
the WAN (``../shared/PDD.md``).

Routing, per request, from what the MD lacks and what the WAN is doing:

* what the MD lacks = prompt tokens beyond its cached prefix (a shadow ``PrefixIndex`` of
  the prompts sent to it; with ``drc=off`` the MD caches nothing, so it lacks everything);
* how long that would wait = ``WanEstimator.wait_s`` (backlog of transfers in flight +
  this delta, at the configured rate corrected by what finished transfers achieved);
* **P-MD** when that wait is at most ``relay_s`` (a small delta: no relay needed);
  **P-RLD-MD** otherwise: KV goes to the RLD over the LAN and, in parallel, the missing
  part to the MD over the WAN; the RLD streams eager tokens and hands over by token IDs
  (``workers/handoff.py``) once the MD holds the KV;
* with ``filter=predict``, a request flagged ``short_output`` whose delta is at least
  ``low_hit`` of its prompt stays on the RLD alone (**P-RLD**): its WAN transfer would
  occupy the line for nothing. Counted in ``stats()``: doing this for every low-hit
  request would overload the RLD.

When the RLD finishes a request before the MD holds its KV, the WAN transfer is cut off
(bytes stop) and the MD's reservation freed (``cutoff=all``); with ``cutoff=anomalous`` (the
default) only if the request is the anomalous kind: low hit at P (it computed at least
``low_hit`` of the prompt: fresh content) or flagged ``short_output``. Otherwise the KV
still lands in the MD's cache, as the history a session's next turn will extend; cutting
those off would keep the MD's cache cold and push every later turn onto the RLD.
``cutoff=off`` never cuts.

Options (``pdd:key=value,...``): ``handoff`` one-shot | catch-up | adaptive (one-shot while
the RLD has at least ``load`` requests in flight, catch-up otherwise); ``threshold`` (catch-up
batch, tokens, default 64); ``load`` (default 4); ``relay_s`` (default 0.2); ``drc`` on | off;
``filter`` off | predict; ``low_hit`` (default 0.5); ``cutoff`` all | anomalous | off;
``eager`` (start the handoff after exactly this many eager tokens, the relay holding there
until the MD is ready; for experiments and tests; a request's ``eager`` meta field
overrides it).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from testbed.policies.base import ClusterView, Plan, Policy, RequestState
from testbed.policies.prefix_index import PrefixIndex
from testbed.policies.wan import WanEstimator

HANDOFF_MODES = ("one-shot", "catch-up", "adaptive")
UNSHAPED_RATE_BPS = 10e9  # assumed line rate when the scenario leaves the WAN unshaped


def _num(name: str, value: str, lo: float, cast: type = float) -> Any:
    try:
        v = cast(value)
    except ValueError as e:
        raise ValueError(f"option {name}={value!r}: expected a number") from e
    if v < lo:
        raise ValueError(f"option {name}={value!r}: must be at least {lo}")
    return v


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"option {name}={value!r}: expected one of {', '.join(allowed)}")
    return value


class Pdd(Policy):
    name = "pdd"

    def __init__(self, handoff: str = "adaptive", threshold: str = "64", load: str = "4", relay_s: str = "0.2",
                 drc: str = "on", filter: str = "off", low_hit: str = "0.5", cutoff: str = "anomalous",
                 eager: str | None = None) -> None:
        self.handoff = _choice("handoff", handoff, HANDOFF_MODES)
        self.threshold = _num("threshold", threshold, 1, int)
        self.load = _num("load", load, 1, int)
        self.relay_s = _num("relay_s", relay_s, 0.0)
        self.drc = _choice("drc", drc, ("on", "off")) == "on"
        self.filter = _choice("filter", filter, ("off", "predict"))
        self.low_hit = _num("low_hit", low_hit, 0.0)
        self.cutoff = _choice("cutoff", cutoff, ("all", "anomalous", "off"))
        self.eager = None if eager is None else _num("eager", eager, 0, int)
        self.options = {"handoff": handoff, "threshold": threshold, "load": load, "relay_s": relay_s, "drc": drc,
                        "filter": filter, "low_hit": low_hit, "cutoff": cutoff}
        if eager is not None:
            self.options["eager"] = eager
        self.indexes: dict[str, PrefixIndex] = {}
        self.wan = WanEstimator(UNSHAPED_RATE_BPS)
        self.counts: Counter[str] = Counter()

    def describe(self) -> str:
        return "pdd:" + ",".join(f"{k}={v}" for k, v in self.options.items())

    def bind(self, ctx: Any) -> None:
        super().bind(ctx)
        self.wan = WanEstimator(ctx.wan_rate_bps or UNSHAPED_RATE_BPS, ctx.wan_rtt_s)

    # ----------------------------------------------------------------- routing
    def plan(self, req: RequestState, cluster: ClusterView) -> Plan:
        p = cluster.pick("prefill")
        md = cluster.pick_outside("decode", p.dc)
        index = self.indexes.setdefault(md.name, PrefixIndex(self.ctx.block_size, self.ctx.decode_cache_tokens))
        have = index.match(req.prompt) if self.drc else 0
        delta = max(0, req.prompt_len - have)
        delta_bytes = delta * self.ctx.kv_bytes_per_token
        wait = self.wan.wait_s(delta_bytes)
        info = {"md_have_tokens": have, "delta_tokens": delta, "delta_bytes": delta_bytes, "est_wan_wait_s": wait,
                "wan_backlog_bytes": self.wan.backlog_bytes(), "wan_efficiency": self.wan.efficiency}
        if (self.filter == "predict" and req.meta.get("short_output") and req.prompt_len
                and delta >= self.low_hit * req.prompt_len):
            rld = cluster.pick("relay-decode", dc=p.dc)
            self.counts["P-RLD (filtered)"] += 1
            return Plan("P-RLD", p.name, rld.name, info=info)
        self.wan.started(req.rid, delta_bytes)
        if wait > self.relay_s:
            rld = cluster.pick("relay-decode", dc=p.dc)
            self.counts["P-RLD-MD"] += 1
            return Plan("P-RLD-MD", p.name, md.name, relay=rld.name, info=info)
        self.counts["P-MD"] += 1
        return Plan("P-MD", p.name, md.name, info=info)

    def decode_options(self, req: RequestState, plan: Plan, worker: str) -> dict[str, Any]:
        if worker == plan.relay:
            budget = req.meta.get("eager", self.eager)  # a trace may fix it per request
            budget = budget if isinstance(budget, int) and budget >= 0 else self.eager
            return {"relay_for": plan.decode, "eager_budget": budget}
        if plan.relay:
            return {"held": True, "relay": plan.relay, "drc": self.drc}
        return {"drc": self.drc}

    def handoff_options(self, req: RequestState, cluster: ClusterView) -> dict[str, Any]:
        mode = self.handoff
        if mode == "adaptive":
            assert req.plan is not None and req.plan.relay is not None
            busy = cluster.workers[req.plan.relay].assigned
            mode = "one-shot" if busy >= self.load else "catch-up"
        self.counts[f"handoff {mode}"] += 1
        return {"mode": mode, "batch": self.threshold}

    def cut_off(self, req: RequestState) -> bool:
        if self.cutoff != "anomalous":
            return self.cutoff == "all"
        if not self.drc:
            return True  # no cache on the MD to keep the KV in
        prefill = next((e for e in req.meta.get("events", []) if e["kind"] == "prefill_done"), {})
        fresh = prefill.get("computed", req.prompt_len) >= self.low_hit * req.prompt_len
        cut = bool(fresh or req.meta.get("short_output"))
        self.counts["cut off" if cut else "kept for the MD cache"] += 1
        return cut

    def on_event(self, req: RequestState, kind: str, worker: str, data: dict[str, Any]) -> None:
        plan = req.plan
        if plan is None:
            return
        if kind == "kv_sent" and data.get("to") == plan.decode:
            self.wan.finished(req.rid, data.get("end", 0) - data.get("start", 0), bool(data.get("cancelled")))
        elif kind == "kv_received" and worker == plan.decode and self.drc and plan.pipeline != "P-RLD":
            # Only now does the MD hold this prompt (a cut-off transfer never gets here).
            self.indexes[worker].insert(req.prompt)
        elif kind == "done" and worker == plan.relay and data.get("handed_off") is False:
            self.counts["finished on RLD"] += 1
        elif kind == "failed":
            self.wan.inflight.pop(req.rid, None)

    def stats(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "wan_efficiency": self.wan.efficiency, "wan_samples": self.wan.samples,
                "options": self.options}
