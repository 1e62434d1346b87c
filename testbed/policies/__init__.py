"""Routing policies: swappable objects behind one interface (``Policy``).

A policy sees one request's state and the cluster's live view and returns a ``Plan``:
which prefill worker computes it and which decode worker(s) get its KV and stream it.
Workers know nothing of policies; they execute typed commands. The command-line spelling
``name:k=v,...`` is parsed once into a ``PolicySpec`` (``testbed/policies/spec.py``);
``make_policy(spec)`` builds the object.
"""

from __future__ import annotations

from testbed.policies.base import ClusterView, Plan, Policy, RequestState
from testbed.policies.classic import CrossDc, SameDc
from testbed.policies.offload import PrefillOffload
from testbed.policies.pdd import Pdd
from testbed.policies.spec import (
    CrossDcSpec,
    OffloadSpec,
    PddSpec,
    PolicySpec,
    SameDcSpec,
    parse_policy,
    parse_policy_list,
)


def make_policy(spec: PolicySpec) -> Policy:
    if isinstance(spec, PddSpec):
        return Pdd(spec.options)
    if isinstance(spec, OffloadSpec):
        return PrefillOffload(spec.options)
    if isinstance(spec, CrossDcSpec):
        return CrossDc()
    assert isinstance(spec, SameDcSpec)
    return SameDc()


__all__ = ["ClusterView", "Plan", "Policy", "PolicySpec", "RequestState", "make_policy", "parse_policy",
           "parse_policy_list"]
