"""The broker's least privilege, on a live emulated network (root): per-component
credentials and ACLs, mosquitto off root, secrets in 0600 files."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pwd
import threading
from pathlib import Path
from typing import Any

import aiomqtt

from protocol.messages import QOS, Topics
from protocol.worker_config import BrokerInfo
from testbed.deploy.broker import MOSQUITTO_USER, start_broker
from testbed.deploy.deployment import network_session
from testbed.net import netns
from testbed.scenario import Role

from .conftest import needs_root, scenario_with

pytestmark = needs_root

WORKERS = {"prefill": "prefill", "relay": "relay-decode", "decode-a": "decode", "decode-b": "decode"}


def _in_namespace(ns: str, body: Any) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        with netns.entered(ns):
            async def main() -> None:
                asyncio.get_running_loop().set_default_executor(
                    concurrent.futures.ThreadPoolExecutor(2, initializer=netns.join, initargs=(ns,)))
                out["value"] = await body()

            try:
                asyncio.run(main())
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _connect(b: BrokerInfo, ident: str) -> aiomqtt.Client:
    return aiomqtt.Client(b.host, b.port, username=b.username, password=b.password, identifier=ident)


def test_each_component_reads_and_writes_only_its_own_topics() -> None:
    with network_session(scenario_with(), "auto") as net:
        proc, access = start_broker(net, net.scenario.hosts_with_role(Role.ROUTER)[0], WORKERS)
        t = Topics(net.run.run_id)
        ns = net.ns_of(net.scenario.hosts_with_role(Role.CLIENT)[0])

        async def body() -> dict[str, list[str]]:
            async with _connect(access.admin, "admin") as admin, \
                    _connect(access.workers["prefill"], "w-prefill") as prefill, \
                    _connect(access.workers["relay"], "w-relay") as relay, \
                    _connect(access.client, "client") as client:
                # mosquitto grants every subscription and applies "read" on delivery.
                await admin.subscribe(f"{t.root}/#", qos=QOS)
                await prefill.subscribe(t.cmd("relay"), qos=QOS)  # not its topic
                await prefill.subscribe(t.cmd("prefill"), qos=QOS)
                await client.subscribe(t.all_tokens, qos=QOS)
                await client.subscribe(t.all_streams, qos=QOS)
                await client.subscribe(t.events, qos=QOS)  # not its topic
                await prefill.publish(t.requests, b"request from prefill", qos=QOS)  # not its topic: dropped
                await prefill.publish(t.cmd("decode-a"), b"prefill to decode-a", qos=QOS)  # dropped
                await relay.publish(t.cmd("decode-b"), b"relay to decode-b", qos=QOS)  # the handoff: allowed
                await relay.publish(t.stream("relay"), b"relay's tokens", qos=QOS)  # its own stream
                await relay.publish(t.stream("prefill"), b"relay as prefill", qos=QOS)  # another's: dropped
                await client.publish(t.requests, b"request from client", qos=QOS)
                await client.publish(t.events, b"event from client", qos=QOS)  # dropped
                for topic in (t.cmd("relay"), t.cmd("prefill"), t.events, t.tokens("r1")):
                    await admin.publish(topic, f"admin to {topic.removeprefix(t.root + '/')}".encode(), qos=QOS)
                seen: dict[str, list[str]] = {"admin": [], "prefill": [], "client": []}

                async def collect(name: str, c: aiomqtt.Client) -> None:
                    # For a while: what was allowed arrives, what was dropped never does.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.5):
                            async for msg in c.messages:
                                seen[name].append(bytes(msg.payload).decode())  # type: ignore[arg-type]

                await asyncio.gather(collect("admin", admin), collect("prefill", prefill), collect("client", client))
            return seen

        got = _in_namespace(ns, body)
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        files = {p.name: os.stat(p) for p in (net.run.dir / "broker").iterdir() if p.name in ("passwd", "acl")}
    assert uid == pwd.getpwnam(MOSQUITTO_USER).pw_uid  # mosquitto dropped root
    mosq = pwd.getpwnam(MOSQUITTO_USER).pw_uid
    assert {n: (st.st_uid, st.st_mode & 0o777) for n, st in files.items()} == {"passwd": (mosq, 0o600),
                                                                               "acl": (mosq, 0o600)}
    seen = {k: set(v) for k, v in got.items()}
    assert seen["prefill"] == {"admin to worker/prefill/cmd"}, seen
    assert seen["client"] == {"admin to tokens/r1", "relay's tokens"}, seen
    sent_by_components = seen["admin"] - {m for m in seen["admin"] if m.startswith("admin to")}
    assert sent_by_components == {"relay to decode-b", "relay's tokens", "request from client"}, seen
