"""Exceptions with a user-facing meaning. The CLI maps each to an exit code."""


class TestbedError(Exception):
    """Base class; the message is shown to the user as is."""

    exit_code = 1


class InputError(TestbedError):
    """Bad user input (scenario, trace, CLI): the message names file, line and field."""

    exit_code = 2


class BuildError(TestbedError):
    """The network (or a process) could not be built; what was built has been undone."""

    exit_code = 3


class CapabilityError(TestbedError):
    """The machine lacks something the requested configuration needs (e.g. netem)."""

    exit_code = 4


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so that teardown runs as on Ctrl-C."""
