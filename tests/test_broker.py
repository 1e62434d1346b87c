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
import pytest

from protocol.messages import QOS
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo
from testbed.deploy.broker import MOSQUITTO_USER, launch_broker, start_broker
from testbed.deploy.deployment import network_session
from testbed.net import netns
from testbed.scenario import Role
from workers.privilege import OutDir, open_regular

from .conftest import needs_root, scenario_with, status_of

pytestmark = [needs_root, pytest.mark.hostile]

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
        proc, access, _ = start_broker(net, net.scenario.hosts_with_role(Role.ROUTER)[0], WORKERS)
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
                await client.subscribe(t.all_events, qos=QOS)  # not its topic
                await prefill.publish(t.requests, b"request from prefill", qos=QOS)  # not its topic: dropped
                await prefill.publish(t.cmd("decode-a"), b"prefill to decode-a", qos=QOS)  # dropped
                await relay.publish(t.cmd("decode-b"), b"relay commands decode-b", qos=QOS)  # the router's: dropped
                await relay.publish(t.peer("decode-b", "relay"), b"relay to decode-b", qos=QOS)  # the handoff
                await relay.publish(t.peer("decode-b", "decode-a"), b"relay as decode-a", qos=QOS)  # dropped
                await relay.publish(t.stream("relay"), b"relay's tokens", qos=QOS)  # its own stream
                await relay.publish(t.stream("prefill"), b"relay as prefill", qos=QOS)  # another's: dropped
                await client.publish(t.requests, b"request from client", qos=QOS)
                await client.publish(t.events("prefill"), b"event from client", qos=QOS)  # dropped
                await prefill.publish(t.events("prefill"), b"prefill's event", qos=QOS)  # its own events
                await prefill.publish(t.events("relay"), b"prefill as relay", qos=QOS)  # another's: dropped
                for topic in (t.cmd("relay"), t.cmd("prefill"), t.events("relay"), t.tokens("r1")):
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
        files = {p.name: os.stat(p) for p in (net.run.dir / "broker").iterdir()}
        folders = {name: os.stat(net.run.dir / name) for name in ("broker", "broker-state")}
    mosq = pwd.getpwnam(MOSQUITTO_USER)
    assert uid == mosq.pw_uid  # mosquitto dropped root
    # What mosquitto runs on is root's; what it may write is its sessions' folder alone.
    assert {n: (st.st_uid, st.st_gid, st.st_mode & 0o777) for n, st in files.items()} == {
        "passwd": (0, mosq.pw_gid, 0o640), "acl": (0, mosq.pw_gid, 0o640),
        "passwd-clients": (0, mosq.pw_gid, 0o640), "acl-clients": (0, mosq.pw_gid, 0o640),
        "mosquitto.conf": (0, 0, 0o600), "mosquitto.log": (0, 0, 0o600)}
    assert {n: (st.st_uid, st.st_gid, st.st_mode & 0o777) for n, st in folders.items()} == {
        "broker": (0, mosq.pw_gid, 0o750), "broker-state": (mosq.pw_uid, mosq.pw_gid, 0o700)}
    seen = {k: set(v) for k, v in got.items()}
    assert seen["prefill"] == {"admin to worker/prefill/cmd"}, seen
    assert seen["client"] == {"admin to tokens/r1", "relay's tokens"}, seen
    sent_by_components = seen["admin"] - {m for m in seen["admin"] if m.startswith("admin to")}
    assert sent_by_components == {"relay to decode-b", "relay's tokens", "request from client", "prefill's event"}, \
        seen


def test_no_credential_takes_over_another_components_session() -> None:
    """decode-a's credential connects under the router's and prefill's client ids (MQTT would
    drop the holder of an id and hand its session, queued commands included, to the newcomer):
    the broker gives it its own account's id instead, so prefill stays connected and gets its
    commands, the rogue none; on the clients' listener that credential is refused outright."""
    with network_session(scenario_with(), "auto") as net:
        _, access, _ = start_broker(net, net.scenario.hosts_with_role(Role.ROUTER)[0], WORKERS)
        t = Topics(net.run.run_id)
        ns = net.ns_of(net.scenario.hosts_with_role(Role.CLIENT)[0])
        victim, rogue = access.workers["prefill"], access.workers["decode-a"]

        async def body() -> dict[str, Any]:
            out: dict[str, Any] = {"victim": [], "rogue": []}
            async with _connect(access.admin, "admin") as admin, _connect(victim, victim.username) as v:
                await v.subscribe(t.cmd("prefill"), qos=QOS)
                await admin.publish(t.cmd("prefill"), b"before", qos=QOS)
                for ident in (f"{t.root}-router", victim.username, f"{t.root}-prefill"):
                    async with aiomqtt.Client(rogue.host, rogue.port, username=rogue.username,
                                              password=rogue.password, identifier=ident, clean_session=False) as r:
                        await r.subscribe(t.cmd("prefill"), qos=QOS)  # not its topic, whoever it says it is
                        await admin.publish(t.cmd("prefill"), f"while {ident} is claimed".encode(), qos=QOS)
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.5):
                                async for msg in r.messages:
                                    out["rogue"].append(bytes(msg.payload).decode())  # type: ignore[arg-type]
                await admin.publish(t.cmd("prefill"), b"after", qos=QOS)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        async for msg in v.messages:
                            out["victim"].append(bytes(msg.payload).decode())  # type: ignore[arg-type]
            try:
                async with aiomqtt.Client(rogue.host, access.client.port, username=rogue.username,
                                          password=rogue.password, identifier=f"{t.root}-client-x"):
                    out["clients' listener"] = "connected"
            except aiomqtt.MqttError as e:
                out["clients' listener"] = str(e)
            return out

        got = _in_namespace(ns, body)
    assert got["rogue"] == []
    assert got["victim"] == ["before", f"while {t.root}-router is claimed", f"while {victim.username} is claimed",
                             f"while {t.root}-prefill is claimed", "after"], got
    assert "authori" in got["clients' listener"].lower() or "refused" in got["clients' listener"].lower(), got


def _as_mosquitto(fn: Any) -> Any:
    """``fn()`` in a child process running as the broker's account: what a compromised
    broker could do."""
    mosq = pwd.getpwnam(MOSQUITTO_USER)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(mosq.pw_gid, mosq.pw_gid, mosq.pw_gid)
            os.setresuid(mosq.pw_uid, mosq.pw_uid, mosq.pw_uid)
            os.write(w, repr(fn()).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, f"{type(e).__name__}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_a_compromised_broker_account_cannot_change_what_root_starts_it_on(tmp_path: Path) -> None:
    """The broker's account tries what a compromised broker would: rewrite its configuration
    (``user root``), plant links where root writes. Its configuration is not its own to
    write; a broker restart writes every file again and starts mosquitto off root; root
    opens nothing through the links."""
    secret = tmp_path / "root-only"
    secret.write_text("root's")
    secret.chmod(0o600)
    with network_session(scenario_with(), "auto") as net:
        router = net.scenario.hosts_with_role(Role.ROUTER)[0]
        proc, _, files = start_broker(net, router, WORKERS)
        conf, state = net.run.dir / "broker" / "mosquitto.conf", net.run.dir / "broker-state"

        def rewrite() -> str:
            with open(conf, "a") as f:
                f.write("user root\n")
            return "written"

        def plant() -> str:
            (state / "mosquitto.log").symlink_to(secret)
            (state / "mosquitto.db").symlink_to(secret)
            return "planted"

        assert _as_mosquitto(rewrite) == "PermissionError"
        assert _as_mosquitto(lambda: os.rename(conf, state / "x")) == "PermissionError"
        assert _as_mosquitto(plant) == "'planted'"
        # Root itself tampers, as a broker that had won would have: the restart undoes it.
        with open(conf, "a") as f:
            f.write("user root\n")
        netns.stop_child(proc, 10)
        restarted = launch_broker(net, router, files)
        st = status_of(restarted.pid)
        conf_text = conf.read_text()
    assert st["Uid"].split()[0] == str(pwd.getpwnam(MOSQUITTO_USER).pw_uid), st["Uid"]
    assert "user root" not in conf_text and f"user {MOSQUITTO_USER}" in conf_text
    assert secret.read_text() == "root's"  # mosquitto saved its sessions over the link, not through it


def test_root_opens_no_link_and_no_fifo_an_unprivileged_process_left(tmp_path: Path) -> None:
    """A log root opens for a child, a file of the output folder: a link is refused, a FIFO
    is refused at once (it would block the opener), a new file is 0600."""
    target = tmp_path / "target"
    target.write_text("root's")
    (tmp_path / "link.log").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.jsonl")
    for bad in ("link.log", "fifo.jsonl"):
        with pytest.raises(OSError):
            os.close(open_regular(tmp_path / bad, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        with pytest.raises(OSError):
            os.close(OutDir(tmp_path).open(bad))
    with pytest.raises(OSError):
        netns.spawn(None, ["true"], log_path=tmp_path / "link.log")
    netns.spawn(None, ["true"], log_path=tmp_path / "new.log").wait()
    assert (tmp_path / "new.log").stat().st_mode & 0o777 == 0o600
    assert target.read_text() == "root's"
