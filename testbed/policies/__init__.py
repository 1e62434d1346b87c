"""Routing policies: classes behind one interface (``Policy``), registered by name.

A policy sees one request's state and the cluster's live view and returns a ``Plan``:
which prefill worker computes it and which decode worker(s) get its KV and stream it.
Workers know nothing of policies; they execute typed commands. The command-line spelling
``name:k=v,...`` (or ``FILE.py:Class:k=v,...`` for a user's plugin, ``docs/policies.md``) is
parsed once into a ``PolicySpec`` (``registry.parse_policy``); ``make_policy(spec)`` builds
the object. The built-ins register themselves as a plugin does.
"""

from __future__ import annotations

from protocol.policy import PolicySpec
from testbed.policies import classic, colocated, offload, pdd  # noqa: F401 - the built-ins register themselves
from testbed.policies.base import ClusterView, NoOptions, Plan, Policy, RequestState, WorkerView
from testbed.policies.registry import (
    PolicyError,
    describe,
    load_plugin,
    make_policy,
    parse_policy,
    parse_policy_list,
    policy_class,
    register,
    registered,
    spec_for,
)

__all__ = ["ClusterView", "NoOptions", "Plan", "Policy", "PolicyError", "PolicySpec", "RequestState", "describe",
           "load_plugin", "make_policy", "parse_policy", "parse_policy_list", "policy_class", "register",
           "registered", "spec_for", "WorkerView"]
