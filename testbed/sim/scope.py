"""What the simulator can represent, checked before anything runs (light: the command line imports it).

The simulator prices every worker's steps as the emulated model on its device profile, so
a worker on a device without a roofline (the emulation times such a worker by the host CPU
that computes it) and a scenario that emulates no model are refused by name, as are the
emulation's test-only worker faults. Everything else a scenario states (modeled or real
compute, either network backend, WAN traces, faults, failure detection) it represents.
"""

from __future__ import annotations

from protocol.worker_config import WorkerFaults
from testbed.errors import InputError
from testbed.scenario import Role, Scenario

WORKER_ROLES = (Role.PREFILL, Role.DECODE, Role.RELAY_DECODE, Role.COLOCATED)


def check_simulable(sc: Scenario, worker_faults: dict[str, WorkerFaults] | None = None) -> None:
    """Refuse, naming it, what the simulator cannot represent (InputError)."""
    if sc.emulation is None:
        raise InputError(f"{sc.source}: emulation: the simulator prices every step as the emulated model on its "
                         "device; this scenario emulates no model (its workers are timed by the host CPU): "
                         "use --engine emulation")
    for dc_name, dc in sc.datacenters.items():
        for host, spec in dc.hosts.items():
            if spec.role not in WORKER_ROLES:
                continue
            dev = sc.device_spec(host)
            if dev.peak_tflops is None or dev.mem_gbps is None:
                raise InputError(f"{sc.source}: datacenters.{dc_name}.hosts.{host}.device: {dev.name} has no "
                                 "roofline (peak_tflops and mem_gbps): the simulator cannot price its steps "
                                 "(the emulation times such a worker by the host CPU); use --engine emulation")
    if worker_faults and any(f != WorkerFaults() for f in worker_faults.values()):
        raise InputError("worker faults (die_after_tokens, corrupt_block) are the emulation's test faults: "
                         "the simulator does not take them; use --fault for faults in emulated time")
