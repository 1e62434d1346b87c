"""The default scenario's network (``two-dc.yaml``) as a Mininet ``Topo``.

    testbed run --topo topologies/two_dc_topo.py:TwoDcTopo --trace ...

Models, devices and the emulation come from ``--scenario`` (default ``two-dc.yaml``); this
file says what a Mininet topology can: hosts with their role (and device), one switch per
datacenter, the LAN rate on the host links and the WAN line on the one switch-to-switch
link, in Mininet's units (``bw`` Mbit/s, ``delay``/``jitter`` as time strings, ``loss`` %).
The figures are the emulated system's, as in ``two-dc.yaml``.
"""

from mininet.topo import Topo

RDMA_LAN = {"bw": 400_000}  # 400 Gbit/s per host inside a datacenter


class TwoDcTopo(Topo):
    def build(self) -> None:
        a = self.addSwitch("s1", dc="a")
        b = self.addSwitch("s2", dc="b")
        for name, params in {
            "client": {"role": "client"},
            "router": {"role": "router"},
            "prefill": {"role": "prefill", "device": "h100"},
            "relay": {"role": "relay-decode", "device": "h100"},
            "decode-a": {"role": "decode", "device": "h100"},
        }.items():
            self.addLink(self.addHost(name, **params), a, **RDMA_LAN)
        self.addLink(self.addHost("decode-b", role="decode", device="h20"), b, **RDMA_LAN)
        # 3.6 Gbit/s (why: two-dc.yaml), 15 ms each way (30 ms RTT), 0.5 ms jitter: a
        # city-to-city line.
        self.addLink(a, b, bw=3_600, delay="15ms", jitter="0.5ms", loss=0)
