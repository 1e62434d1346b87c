"""The two engines a replay runs on, as objects: what each is, so that no floor of the
testbed compares an engine's name (``RunOptions.engine`` and a saved summary's ``engine``
hold the name; ``kind`` turns it into this).

* **emulation**: real processes in namespaces, real bytes through a shaped line, workers
  paced to modeled devices in dilated real time (root; one replay per host at a time);
* **sim**: the same router, policies and workers in virtual time with the network modeled
  (no root; replays side by side, a process each).

What each engine builds for a replay (its plan and its deployment) is
``testbed/experiments/engine_runs.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import InputError


@dataclass(frozen=True)
class EngineKind:
    name: str
    virtual_time: bool  # durations are the model's, not a host's: no dilation, no fidelity to judge
    parallel: bool  # several replays at once here, a process each
    needs_root: bool
    about: str  # one line, as runs print it

    def __str__(self) -> str:
        return self.name


EMULATION = EngineKind("emulation", virtual_time=False, parallel=False, needs_root=True,
                       about="the emulation (processes, namespaces, a shaped line)")
SIMULATION = EngineKind("sim", virtual_time=True, parallel=True, needs_root=False,
                        about="the simulator (the same code in virtual time; docs/simulation.md)")
KINDS = {k.name: k for k in (EMULATION, SIMULATION)}


def kind(name: str) -> EngineKind:
    try:
        return KINDS[name]
    except KeyError:
        raise InputError(f"--engine: {name!r} is not an engine ({', '.join(KINDS)})") from None
