"""The router's policy and its decisions: built from its spec on first use, and every
decision of it guarded, so that a policy's bug fails the request it was deciding, never the
router (a plugin is user code, ``docs/policies.md``)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TypeVar

from protocol.policy import PolicyContext, PolicySpec
from testbed.policies import Policy, make_policy

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

    @property
    def policy(self) -> Policy:
        """Built on first use (the router's ``main`` uses it first): a plugin's class was
        imported before the router dropped root (its file root's and writable by no one else,
        ``testbed.policies.registry.trusted``); its object runs without root."""
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
