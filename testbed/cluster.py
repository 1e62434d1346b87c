"""Start the inference side on a built network: broker, workers, router; run a client.

``Cluster`` turns the scenario's hosts into processes: mosquitto and the router on the
``router`` host, a prefill worker on each ``prefill`` host, a decode worker on each
``decode`` and each ``relay-decode`` host (the same worker; a relay's part in PDD is set
per request by the router). Every process is started inside its namespace and recorded in the run, so
teardown (and ``testbed clean`` after a crash) ends them by PID.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.broker import BrokerInfo, start_broker
from testbed.client import ClientRecord, RequestSpec, replay_in_namespace
from testbed.errors import InputError
from testbed.net.build import Network
from testbed.scenario import Role
from workers.control import Topics
from workers.model import ensure_default_model, kv_bytes_per_token

KV_PORT = 7070
WORKER_ROLES = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.RELAY_DECODE: "relay-decode"}


@dataclass
class Cluster:
    net: Network
    policy: str
    broker: BrokerInfo
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    router: subprocess.Popen[bytes] = field(init=False)

    @property
    def topics(self) -> Topics:
        return Topics(self.net.run.run_id)

    @property
    def records_path(self) -> Path:
        return self.net.run.dir / "router-records.jsonl"

    @classmethod
    def start(cls, net: Network, policy: str, faults: dict[str, dict[str, Any]] | None = None,
              dtype: str | None = None) -> Cluster:
        sc = net.scenario
        routers = sc.hosts_with_role(Role.ROUTER)
        if not routers:
            raise InputError(f"{sc.source}: scenario has no host with role router")
        _, broker = start_broker(net, routers[0])
        cl = cls(net, policy, broker, faults=faults or {})
        ws = sc.workers
        model = str(ws.model) if ws.model else str(ensure_default_model())
        for dc_name, dc in sc.datacenters.items():
            for host, spec in dc.hosts.items():
                role = WORKER_ROLES.get(spec.role)
                if role is None:
                    continue
                dev = sc.devices.get(spec.device)
                cfg = {
                    "name": host, "role": role, "run_id": net.run.run_id, "host_ip": net.ip_of(host),
                    "kv_port": KV_PORT, "broker_host": broker.host, "broker_port": broker.port,
                    "broker_user": broker.username, "broker_password": broker.password,
                    "model_path": model, "dtype": dtype or ws.dtype, "threads": ws.threads,
                    "block_size": ws.block_size, "prefill_chunk": ws.prefill_chunk,
                    "cache_tokens": ws.prefill_cache_tokens if role == "prefill" else ws.decode_cache_tokens,
                    "max_batch": ws.max_batch, "kv_timeout_s": ws.kv_timeout_s, "device": spec.device,
                    "peak_tflops": dev.peak_tflops if dev else None, "mem_gbps": dev.mem_gbps if dev else None,
                    "step_overhead_ms": dev.step_overhead_ms if dev else 0.0,
                    "stats_path": str(net.run.dir / f"worker-{host}.json"),
                    "faults": cl.faults.get(host, {}),
                }  # fmt: skip
                path = net.run.dir / f"worker-{host}.cfg.json"
                path.write_text(json.dumps(cfg))
                net.spawn(host, [sys.executable, "-m", "workers", str(path)], name=f"worker-{host}",
                          log=net.run.dir / f"worker-{host}.log")
                cl.workers[host] = {"role": role, "dc": dc_name, "host": net.ip_of(host), "kv_port": KV_PORT}
        fwd = sc.wan.forward
        context = {
            "wan_rate_bps": fwd.rate_mbit * 1e6 if fwd.rate_mbit else None, "wan_rtt_s": 2 * fwd.delay_ms / 1000,
            "kv_bytes_per_token": kv_bytes_per_token(model, dtype or ws.dtype), "block_size": ws.block_size,
            "decode_cache_tokens": ws.decode_cache_tokens,
        }
        rcfg = {
            "run_id": net.run.run_id, "broker_host": broker.host, "broker_port": broker.port,
            "broker_user": broker.username, "broker_password": broker.password, "policy": policy,
            "workers": cl.workers, "request_timeout_s": ws.request_timeout_s,
            "records_path": str(cl.records_path), "context": context,
        }  # fmt: skip
        rpath = net.run.dir / "router.cfg.json"
        rpath.write_text(json.dumps(rcfg))
        cl.router = net.spawn(routers[0], [sys.executable, "-m", "testbed.router", str(rpath)], name="router",
                              log=net.run.dir / "router.log")
        return cl

    def replay(self, specs: list[RequestSpec], timeout_s: float = 900.0,
               progress: Callable[[int, int, int], None] | None = None) -> dict[str, ClientRecord]:
        clients = self.net.scenario.hosts_with_role(Role.CLIENT)
        if not clients:
            raise InputError(f"{self.net.scenario.source}: scenario has no host with role client")
        return replay_in_namespace(self.net.ns_of(clients[0]), self.broker, self.topics, specs, timeout_s,
                                   progress)

    def router_records(self) -> dict[str, dict[str, Any]]:
        """Stop the router (it writes its records on exit) and read them."""
        if self.router.poll() is None:
            time.sleep(0.3)  # let the last events (e.g. kv_sent after done) reach it
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        out: dict[str, dict[str, Any]] = {}
        if self.records_path.exists():
            for line in self.records_path.read_text().splitlines():
                rec = json.loads(line)
                out[rec["rid"]] = rec
        return out

    def policy_stats(self) -> dict[str, Any]:
        """The policy's own counters (written by the router on exit)."""
        p = Path(str(self.records_path) + ".policy.json")
        return json.loads(p.read_text()) if p.exists() else {}

    def worker_stats(self) -> dict[str, Any]:
        out = {}
        for host in self.workers:
            p = self.net.run.dir / f"worker-{host}.json"
            if p.exists():
                out[host] = json.loads(p.read_text())
        return out

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.net.run.dir / f"{name}.log"
        return p.read_text()[-n:] if p.exists() else ""
