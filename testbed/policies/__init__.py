"""Routing policies: swappable objects behind one interface (``Policy``).

A policy sees one request's state and the cluster's live view and returns a ``Plan``:
which prefill worker computes it and which decode worker(s) get its KV and stream it.
Workers know nothing of policies; they execute plans. ``make_policy("name:k=v,...")``
builds one from its command-line spelling.
"""

from __future__ import annotations

from testbed.policies.base import ClusterView, Plan, Policy, RequestState
from testbed.policies.classic import CrossDc, SameDc
from testbed.policies.pdd import Pdd

POLICIES: dict[str, type[Policy]] = {"same-dc": SameDc, "cross-dc": CrossDc, "pdd": Pdd}


def make_policy(spec: str) -> Policy:
    name, _, opts = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    options = {}
    for part in filter(None, opts.split(",")):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"policy option {part!r} must be key=value")
        options[k.strip()] = v.strip()
    try:
        return POLICIES[name](**options)
    except TypeError as e:  # an option the policy does not have
        raise ValueError(f"{name}: unknown option among {', '.join(options)}") from e


__all__ = ["ClusterView", "Plan", "Policy", "RequestState", "make_policy", "POLICIES"]
