"""Traces: formats and their loaders, the workload they become, statistics, a generator."""

from testbed.traces.formats import FORMATS, load_trace
from testbed.traces.workload import Workload

__all__ = ["FORMATS", "Workload", "load_trace"]
