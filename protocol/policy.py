"""What crosses between the orchestrator and the router about a routing policy.

* ``PolicySpec``: a policy as named and configured, parsed once at the edge
  (``testbed.policies.registry.parse_policy``) and handed to the router inside its
  ``RouterConfig``: a name, where its class comes from when it is not built in (a plugin's
  file), and the options that were given, already checked against the policy's own options
  model. The router builds the policy from it (``make_policy``) and checks the options again.
* ``PolicyContext``: facts about the deployment a policy may need.
* ``PlanInfo``: why a policy chose a plan (recorded with the request).
* ``PolicyReport``: the policy's own counters, written next to the router's records.

Nothing here knows any policy: the set of policies is open (``docs/policies.md``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from protocol.worker_config import Contract, KvTransfer

# A policy's name: what a user types and what labels its results.
POLICY_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
OptionValue = str | int | float | bool | None


class PolicySpec(Contract):
    name: str = Field(pattern=POLICY_NAME)
    # Where the class comes from: None for a policy registered by name (built in, or a plugin
    # loaded earlier in the same process); otherwise "FILE.py:Class", the absolute path of the
    # plugin's file (a module given as "module:Class" is recorded as its file).
    source: str | None = Field(default=None, max_length=4096)
    options: dict[str, OptionValue] = {}  # only those given, as the policy's options model read them

    @field_validator("options")
    @classmethod
    def _few(cls, v: dict[str, OptionValue]) -> dict[str, OptionValue]:
        if len(v) > 64 or any(len(k) > 64 for k in v):
            raise ValueError("at most 64 options, each name at most 64 characters")
        return v

    @property
    def label(self) -> str:
        """The canonical spelling: the name and the options that were given."""
        shown = ",".join(f"{k}={spell(v)}" for k, v in self.options.items())
        return f"{self.name}:{shown}" if shown else self.name


def spell(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


class PolicyContext(Contract):
    """Facts about the deployment a policy may need (from the scenario and the model). Rates,
    round trips and KV bytes are the wire's (what the router sees in real time); divide a
    real duration by ``dilation`` to compare it with an option given in emulated seconds."""

    wan_rate_bps: float | None = None  # forward direction (prefill side -> other side); None = unshaped
    wan_back_rate_bps: float | None = None  # the reverse direction (towards the prefill side)
    wan_rtt_s: float = 0.0
    dilation: float = Field(default=1.0, gt=0)
    kv_bytes_per_token: int = 0
    kv_state_bytes: int = 0  # a request's fixed-size state every transfer carries (a hybrid card's)
    block_size: int = 16
    decode_cache_tokens: int = 0
    home_dc: str | None = None  # where requests enter (the router's datacenter); None: any
    token_scale: int = Field(default=1, ge=1)  # emulated tokens per replayed token (options in emulated tokens)
    # A hybrid model: a prefill's cache resumes only where a prompt ended (its linear states).
    prefill_exact_states: bool = False
    kv_transfer: KvTransfer = "after-prefill"  # when a prefill's KV leaves unless a plan says (workers.kv_transfer)

    def transfer_bytes(self, tokens: int) -> int:
        """Wire bytes of a transfer of ``tokens`` tokens' KV and the request's state."""
        return tokens * self.kv_bytes_per_token + self.kv_state_bytes


class Candidate(Contract):
    """One worker a decision weighed, as ``--trace-decisions`` records it."""

    worker: str
    score: float | None = None  # the policy's own measure (lower is better for the built-ins: their load)
    note: str = ""  # e.g. "prefix 12 blocks", "dead", "over the line's budget"


class PlanInfo(Contract):
    """Why a policy chose its plan (PDD's routing inputs; empty for the classic policies)."""

    md_have_tokens: int | None = None
    delta_tokens: int | None = None
    delta_bytes: int | None = None
    est_wan_wait_s: float | None = None
    wan_backlog_bytes: float | None = None
    wan_efficiency: float | None = None


class PolicyReport(Contract):
    counts: dict[str, int] = {}
    wan_efficiency: float | None = None
    wan_samples: int | None = None
    options: str = ""  # the policy with every option


class Decision(Contract):
    """One plan as ``--trace-decisions`` records it (``decisions-<policy>.jsonl`` in the run's
    folder): what the policy chose, why (``info``) and the workers it weighed."""

    rid: str
    t: float  # the router's clock when it planned
    pipeline: str | None = None  # None: no plan (the reason in ``error``)
    prefill: str | None = None
    decode: str | None = None
    relay: str | None = None
    hold: list[str] = []
    info: PlanInfo = PlanInfo()
    candidates: list[Candidate] = []
    error: str | None = None
