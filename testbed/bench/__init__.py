"""Benchmarks (slow; ``testbed bench ...`` and ``make bench-*``, never part of ``make test``).

* ``net``: the emulated network's ceiling: WAN goodput, RTT error, build and teardown time.
* ``handoff``: relay -> main decoder handoff, shipping KV vs token IDs + recompute.
"""
