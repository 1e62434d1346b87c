"""pdd-testbed: trace-driven emulation of cross-datacenter prefill/decode disaggregation."""

__version__ = "0.1.0"
