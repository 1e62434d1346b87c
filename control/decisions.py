"""The router's policy and its decisions: built from its spec on first use, and every
decision of it guarded, so that a policy's bug fails the request it was deciding, never the
router (a plugin is user code, ``docs/policies.md``)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TextIO, TypeVar

from protocol import clock
from protocol.policy import Candidate, Decision, PolicyContext, PolicySpec
from protocol.refusals import refusal
from testbed.policies import Plan, Policy, make_policy

T = TypeVar("T")


class PolicyFailed(Exception):
    """A policy's decision raised: the request it was for fails with this reason."""


def raised_at(e: BaseException) -> str:
    """``FILE:LINE`` of the innermost frame that raised ``e``."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


class Decisions:
    def __init__(self, spec: PolicySpec, ctx: PolicyContext) -> None:
        self.spec, self.ctx = spec, ctx
        self._policy: Policy | None = None
        self.traced: TextIO | None = None  # ``--trace-decisions``: a line per plan

    def trace(self, rid: str, plan: Plan | None, weighed: list[Candidate] | None, error: str | None = None) -> None:
        """A plan (or why there is none) with the workers it weighed, when decisions are traced."""
        if self.traced is None:
            return
        d = Decision(rid=rid, t=clock.now(), error=error, candidates=weighed or [])
        if plan is not None:
            d = d.model_copy(update={"pipeline": plan.pipeline, "prefill": plan.prefill, "decode": plan.decode,
                                     "relay": plan.relay, "hold": list(plan.hold), "info": plan.info})
        try:
            self.traced.write(d.model_dump_json() + "\n")
        except OSError as e:  # a trace, not a record: the request goes on
            refusal(f"router: decision of {rid} not traced: {e}")

    @property
    def policy(self) -> Policy:
        """Built on first use (the router's ``main`` uses it first): a plugin's class was
        imported before the router dropped root (its file root's and writable by no one else,
        ``testbed.root_paths.trusted_code``); its object runs without root."""
        if self._policy is None:
            self._policy = make_policy(self.spec)
            self._policy.bind(self.ctx)
        return self._policy

    def decided(self, what: str, decide: Callable[[], T]) -> T:
        """A decision; an exception of the policy's own is ``PolicyFailed`` naming the
        decision and where it raised. ``LookupError`` (no worker can serve the request) passes
        as it is."""
        try:
            return decide()
        except LookupError:
            raise
        except Exception as e:  # noqa: BLE001 - the policy's code: its request fails, with the reason
            raise PolicyFailed(f"policy {self.spec.label}: {what} raised {type(e).__name__}: {e} "
                               f"(at {raised_at(e)})") from e
