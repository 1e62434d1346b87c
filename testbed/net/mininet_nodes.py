"""The Mininet backend: a plan's nodes, links and bridges made with Mininet's own API.

One ``Mininet`` object per run, built step by step (no ``build()``, no controller, no Open
vSwitch: this kernel has no OVS module): a ``Host`` per scenario host, a ``LinuxBridge`` in
its own namespace per datacenter gateway (its bridge device carries the gateway's address
and routes, as ``br0`` does on the pyroute2 backend), a plain namespaced ``Node`` for the
WAN, and a ``Link`` (veth pair) per plan link with the plan's interface names. Each node's
namespace is attached under the run's name (what ``ip netns attach`` does), so the rest of
the testbed (addresses, shaping, the delay line, workers, ``testbed exec``, cleanup) finds
it exactly as on the pyroute2 backend, and each node's shell is a process of the run.

Mininet logs an error and carries on (a failed ``ip link add`` inside ``Link``, a failed
``brctl``); here every step is checked afterwards over netlink, and any error Mininet
logged during it fails the build, naming the step (``BuildError``; the network is then
torn down by its caller).

Two of Mininet's defaults are left out on purpose: ``Mininet.init`` raises host-wide
limits and root-namespace sysctls (``fixLimits``), which would outlive the run (each
namespace here sets its own TCP buffers); and ``mn -c`` cleanup, which matches by name and
leaks (Mininet issues #1174, #790): the run registry removes what the run recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testbed.errors import BuildError, CapabilityError
from testbed.net import netns, runstate
from testbed.net.nodes import NodeKind


def _check_mininet() -> None:
    try:
        import mininet.net  # noqa: F401
    except ImportError as e:
        raise CapabilityError(
            f"the Mininet backend needs Mininet importable from this venv ({e}); `make setup` installs it"
        ) from e
    missing = [tool for tool in ("mnexec", "brctl") if shutil.which(tool) is None]
    if missing:
        raise CapabilityError(f"the Mininet backend needs {', '.join(missing)} on PATH; `make setup` installs them")


class _Errors(logging.Handler):
    """Collects what Mininet logs at error level (it logs and carries on)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().strip())


def _listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in the namespace of process ``pid``."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


def _mininet_class(base: type) -> type:
    """``Mininet`` with an ``iperf`` (the CLI's ``iperf h1 h2``) that works with iperf 2.1:
    Mininet 2.3.0 probes the server with telnet, then waits for a bandwidth line for the
    probe too, which iperf 2.1 no longer prints, so it waits forever. Here the server is
    known to listen once its socket shows in the namespace, and one bandwidth line (or 15 s)
    ends the wait."""

    class TestbedMininet(base):  # type: ignore[misc, valid-type]
        def iperf(self, hosts: list[Any] | None = None, l4Type: str = "TCP", udpBw: str = "10M",
                  fmt: str | None = None, seconds: int = 5, port: int = 5001) -> list[str]:
            from mininet.log import output

            client, server = hosts or (self.hosts[0], self.hosts[-1])
            output(f"*** Iperf: testing {l4Type} bandwidth between {client} and {server}\n")
            args = f"iperf -p {port} " + ("-u " if l4Type == "UDP" else "") + (f"-f {fmt} " if fmt else "")
            server.sendCmd(args + "-s")
            deadline = time.monotonic() + 10
            while l4Type == "TCP" and not _listening(server.pid, port) and time.monotonic() < deadline:
                time.sleep(0.02)
            cliout = client.cmd(args + f"-t {seconds} -c {server.IP()}" + (f" -b {udpBw}" if l4Type == "UDP" else ""))
            servout = ""
            deadline = time.monotonic() + 15
            while "/sec" not in servout and time.monotonic() < deadline:
                servout += server.monitor(timeoutms=1000)
            server.sendInt()
            servout += server.waitOutput()
            result = [self._parseIperf(servout), self._parseIperf(cliout)]
            output(f"*** Results: {result}\n")
            return result

    return TestbedMininet


class MininetNodes:
    """A plan built from Mininet nodes and links (see the module docstring)."""

    name = "mininet"

    def __init__(self, run: runstate.Run) -> None:
        _check_mininet()
        from mininet.link import Link
        from mininet.log import lg
        from mininet.net import Mininet
        from mininet.node import Host, Node
        from mininet.nodelib import LinuxBridge

        self.run = run
        self._classes: dict[NodeKind, type] = {"host": Host, "gateway": LinuxBridge, "wan": Node}
        self._link_cls = Link
        self.errors = _Errors()
        self._lg = lg
        lg.addHandler(self.errors)
        # Every step is checked here; Mininet's own notices (its LinuxBridge warns about the
        # root namespace's bridge-netfilter sysctls, which none of our namespaces use) would
        # only be noise on each run. Its CLI raises the level again.
        lg.setLogLevel("error")
        Mininet.inited = True  # skip Mininet.init's host-wide limits and sysctls (module docstring)
        self.net = _mininet_class(Mininet)(topo=None, controller=None, switch=LinuxBridge, host=Host, build=False,
                                           autoSetMacs=False, waitConnected=False)
        self.by_ns: dict[str, Any] = {}

    @contextlib.contextmanager
    def _checked(self, what: str) -> Iterator[None]:
        before = len(self.errors.messages)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - Mininet raises bare Exceptions
            logged = "".join(f"; {m}" for m in self.errors.messages[before:])
            raise BuildError(f"Mininet: {what}: {e}{logged}") from e
        logged = "; ".join(self.errors.messages[before:])
        if logged:
            raise BuildError(f"Mininet: {what}: {logged}")

    # ---------------------------------------------------------------- NodeBackend
    def add_node(self, ns: str, label: str, kind: NodeKind) -> None:
        cls = self._classes[kind]
        with self._checked(f"node {label}"):
            if kind == "host":
                node = self.net.addHost(label, cls=cls)
            elif kind == "gateway":
                # A gateway's dpid only names it for OpenFlow, which a LinuxBridge never speaks.
                node = self.net.addSwitch(label, cls=cls, inNamespace=True, dpid=f"{len(self.net.switches) + 1:x}")
            else:
                # The WAN forwards at layer 2 without being a switch Mininet starts: a plain
                # node, listed with the switches (``mininet> nodes``, ``wan tc -s qdisc``).
                node = cls(label, inNamespace=True)
                self.net.nameToNode[label] = node
                self.net.switches.append(node)
            self.by_ns[ns] = node
            self.run.add_process(node.pid, runstate.MININET_SHELL, ns)  # the node is its namespace
            netns.attach_namespace(ns, node.pid)
            if netns.ns_inode(ns) == os.stat("/proc/self/ns/net").st_ino:
                raise BuildError(f"Mininet's node {label} shares the orchestrator's namespace")

    def add_link(self, ns_a: str, if_a: str, ns_b: str, if_b: str, mtu: int) -> None:
        a, b = self.by_ns[ns_a], self.by_ns[ns_b]
        with self._checked(f"link {a.name}:{if_a} - {b.name}:{if_b}"):
            self.net.addLink(a, b, intfName1=if_a, intfName2=if_b, cls=self._link_cls)
            for ns, ifname in ((ns_a, if_a), (ns_b, if_b)):
                with netns.iproute(ns) as ipr:
                    found = ipr.link_lookup(ifname=ifname)
                    if not found:
                        raise BuildError(f"{ifname} is missing in {self.by_ns[ns].name}")
                    ipr.link("set", index=found[0], mtu=mtu)

    def add_bridge(self, ns: str, bridge: str, ports: list[str], mtu: int) -> None:
        node = self.by_ns[ns]
        if bridge != node.name:
            raise BuildError(f"a LinuxBridge is named after its node: {bridge!r} in {node.name}")
        with self._checked(f"bridge {bridge}"):
            node.start([])  # LinuxBridge.start: brctl addbr, addif each port named after it
            with netns.iproute(ns) as ipr:
                found = ipr.link_lookup(ifname=bridge)
                if not found:
                    raise BuildError(f"bridge {bridge} was not created (brctl)")
                br = found[0]
                ipr.link("set", index=br, mtu=mtu)
                for port in ports:
                    (link,) = ipr.get_links(ipr.link_lookup(ifname=port)[0])
                    if link.get("master") != br:
                        raise BuildError(f"{port} is not a port of bridge {bridge}")

    def note_address(self, ns: str, ifname: str, ip: str, prefixlen: int) -> None:
        # Mininet reads a node's IP from its interface records (``h.IP()``, ``iperf h1 h2``).
        intf = self.by_ns[ns].nameToIntf.get(ifname)
        if intf is not None:
            intf.ip, intf.prefixLen = ip, prefixlen

    def close(self) -> None:
        """End the nodes' shells and close their terminals; the namespaces stay attached
        until the run's teardown removes them."""
        for node in self.by_ns.values():
            with contextlib.suppress(Exception):
                node.terminate()
        self._lg.removeHandler(self.errors)

    def cli(self) -> None:
        """Mininet's CLI on this emulation, until ``exit`` or end of input."""
        from mininet.cli import CLI

        class TestbedCLI(CLI):  # type: ignore[misc]
            # Host names such as decode-b: ``cmd`` would read "decode" as the command.
            identchars = CLI.identchars + "-"

        self._lg.setLogLevel("output")
        TestbedCLI(self.net)
