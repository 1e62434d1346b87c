"""Exceptions with a user-facing meaning, and the one meaning of each exit status.

- 0: done: every request completed, every fidelity verdict passed (verify: tokens equal).
- 1: finished, but requests failed, tokens differed (verify), a measurement missed its
  configuration (net check), the soak found a hung or lost request, or calibrate did not
  reach its target.
- 2: bad input: scenario, trace, topology or command line (the message names file, line
  and field).
- 3: a fidelity verdict failed: the latencies measure this host, not the emulated system.
- 4: this machine lacks something the configuration needs (netem, Mininet, root).
- 5: the network or a process could not be built; what was built has been undone.
- 130: interrupted (Ctrl-C, SIGTERM, SIGHUP); everything was torn down.
"""

# Exit statuses that are not an exception's (see the table above).
EXIT_OK = 0
EXIT_FAILED_REQUESTS = 1
EXIT_INFIDELITY = 3
EXIT_INTERRUPTED = 130


class TestbedError(Exception):
    """Base class; the message is shown to the user as is."""

    exit_code = 1


class InputError(TestbedError):
    """Bad user input (scenario, trace, CLI): the message names file, line and field."""

    exit_code = 2


class BuildError(TestbedError):
    """The network (or a process) could not be built; what was built has been undone."""

    exit_code = 5


class CapabilityError(TestbedError):
    """The machine lacks something the requested configuration needs (e.g. netem)."""

    exit_code = 4


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM/SIGHUP so that teardown runs as on Ctrl-C. A
    KeyboardInterrupt, because asyncio lets only that (and SystemExit) out of a callback: any
    other exception a handler raises while the loop runs is logged and the loop goes on (a
    simulation ignored SIGTERM)."""
