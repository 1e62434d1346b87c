"""The network backends: who creates a plan's namespaces, veth links and bridges.

``Network`` (``testbed.net.build``) builds the same plan on either backend and does
everything else itself with pyroute2 (addresses, routes, sysctls, shaping, the delay line),
so the two differ only in how nodes and links come to exist:

* ``Pyroute2Nodes``: named namespaces and links made directly over netlink;
* ``MininetNodes`` (``testbed.net.mininet_nodes``): Mininet's ``Host``, ``LinuxBridge`` and
  ``Link`` in a ``Mininet`` object, each node's namespace attached under the run's name.

A backend creates each namespace under the name it is given (the run registry has
recorded it before) and records any process it starts in the run, so teardown and
``testbed clean`` are the same on both.
"""

from __future__ import annotations

from typing import Literal, Protocol

from testbed.net import netns, runstate

NodeKind = Literal["host", "gateway", "wan"]


class NodeBackend(Protocol):
    name: str

    def add_node(self, ns: str, label: str, kind: NodeKind) -> None:
        """Create namespace ``ns`` for the node ``label`` (a scenario host, ``gw-<dc>``, ``wan``)."""

    def add_link(self, ns_a: str, if_a: str, ns_b: str, if_b: str, mtu: int) -> None:
        """A veth pair, ``if_a`` in ``ns_a`` and ``if_b`` in ``ns_b``, both at ``mtu``."""

    def add_bridge(self, ns: str, bridge: str, ports: list[str], mtu: int) -> None:
        """Bridge ``bridge`` in ``ns`` over ``ports`` (links made before), down, no address."""

    def note_address(self, ns: str, ifname: str, ip: str, prefixlen: int) -> None:
        """An address the build gave ``ifname`` (a backend that keeps its own records)."""

    def close(self) -> None:
        """Let go of the backend's own handles (the run's teardown removes the rest)."""


class Pyroute2Nodes:
    """Namespaces and links straight over netlink (``ip netns add`` / ``ip link add``)."""

    name = "pyroute2"

    def __init__(self, run: runstate.Run) -> None:
        self.run = run

    def add_node(self, ns: str, label: str, kind: NodeKind) -> None:
        netns.create_namespace(ns)

    def add_link(self, ns_a: str, if_a: str, ns_b: str, if_b: str, mtu: int) -> None:
        # Created from inside ns_a with the peer placed straight into ns_b: the pair never
        # exists in the root namespace, so concurrent runs cannot collide on names.
        with netns.iproute(ns_a) as ipr:
            ipr.link("add", ifname=if_a, kind="veth", mtu=mtu, peer={"ifname": if_b, "net_ns_fd": ns_b})
        with netns.iproute(ns_b) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=if_b)[0], mtu=mtu)

    def add_bridge(self, ns: str, bridge: str, ports: list[str], mtu: int) -> None:
        with netns.iproute(ns) as ipr:
            ipr.link("add", ifname=bridge, kind="bridge", mtu=mtu)
            br = ipr.link_lookup(ifname=bridge)[0]
            for port in ports:
                ipr.link("set", index=ipr.link_lookup(ifname=port)[0], master=br)

    def note_address(self, ns: str, ifname: str, ip: str, prefixlen: int) -> None:
        return None

    def close(self) -> None:
        return None

