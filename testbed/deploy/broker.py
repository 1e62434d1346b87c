"""MQTT broker lifecycle: mosquitto started by the testbed inside the router's namespace.

A generated config binds one listener to the router host's emulated address only, with no
anonymous access; sessions persist across a restart of the broker (saved when it exits);
nothing from a system-wide mosquitto service is used.
Least privilege (``BrokerAccess``): every component has its own per-run credential and an
ACL that lets it read and write only its own topics (``acl_rules``): a worker reads its
command topic and writes its status, events and token streams (decoders also write the
command topics of the other decoders: PDD's relay and main decoder hand over directly);
the router reads requests, events and statuses and writes commands, rejections and its
status; the client writes requests and reads tokens and the router's status. ``admin``
(the orchestrator: tests, diagnostics) may use every topic of the run. mosquitto drops
root for its own user once its listener is bound; its files are that user's, mode 0600.
"""

from __future__ import annotations

import os
import pwd
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import Topics
from protocol.worker_config import BrokerInfo
from testbed.errors import BuildError
from testbed.net import netns, runstate
from testbed.net.build import Network

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = "/usr/bin/mosquitto_passwd"
MOSQUITTO_USER = "mosquitto"  # created by the Debian package
PORT = 1883
DECODERS = ("decode", "relay-decode")


@dataclass(frozen=True)
class BrokerAccess:
    admin: BrokerInfo
    router: BrokerInfo
    client: BrokerInfo
    workers: dict[str, BrokerInfo]


def acl_rules(topics: Topics, workers: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """Principal -> (access, topic filter) rules; ``workers`` maps worker name -> role."""
    t = topics
    rules: dict[str, list[tuple[str, str]]] = {
        "admin": [("readwrite", f"{t.root}/#")],
        "router": [("read", t.requests), ("read", t.cancels), ("read", t.events), ("read", t.all_status),
                   ("write", t.cmd("+")), ("write", t.all_tokens), ("readwrite", t.router_status)],
        "client": [("write", t.requests), ("write", t.cancels), ("read", t.all_streams), ("read", t.all_tokens),
                   ("read", t.router_status)],
    }
    for name, role in sorted(workers.items()):
        mine = [("read", t.cmd(name)), ("readwrite", t.status(name)), ("write", t.events), ("write", t.stream(name))]
        if role in DECODERS:
            mine += [("write", t.cmd(peer)) for peer, r in sorted(workers.items()) if r in DECODERS and peer != name]
        rules[f"w-{name}"] = mine
    return rules


def acl_text(run_id: str, rules: dict[str, list[tuple[str, str]]]) -> str:
    lines = []
    for principal, rs in rules.items():
        lines.append(f"user {run_id}-{principal}")
        lines += [f"topic {access} {topic}" for access, topic in rs]
        lines.append("")
    return "\n".join(lines)


def _own(path: Path, uid: int | None, gid: int | None, mode: int) -> None:
    if uid is not None and gid is not None:
        os.chown(path, uid, gid)
    path.chmod(mode)


def start_broker(net: Network, router_host: str, workers: dict[str, str]) -> tuple[subprocess.Popen[bytes],
                                                                                    BrokerAccess]:
    d = net.run.dir / "broker"
    d.mkdir(exist_ok=True)
    try:
        owner = pwd.getpwnam(MOSQUITTO_USER)
        uid, gid, user = owner.pw_uid, owner.pw_gid, MOSQUITTO_USER
    except KeyError:  # no such user (not a Debian package): mosquitto keeps running as root
        uid, gid, user = None, None, "root"
    topics = Topics(net.run.run_id)
    rules = acl_rules(topics, workers)
    ip = net.ip_of(router_host)
    creds = {p: BrokerInfo(host=ip, port=PORT, username=f"{net.run.run_id}-{p}", password=secrets.token_urlsafe(16))
             for p in rules}
    pw, acl, conf = d / "passwd", d / "acl", d / "mosquitto.conf"
    # Plain "user:password" lines, then hashed in place by mosquitto_passwd -U; 0600 throughout.
    pw.touch(mode=0o600)
    pw.write_text("".join(f"{c.username}:{c.password}\n" for c in creds.values()))
    subprocess.run([MOSQUITTO_PASSWD, "-U", str(pw)], check=True, capture_output=True)
    acl.touch(mode=0o600)
    acl.write_text(acl_text(net.run.run_id, rules))
    conf.write_text(
        "\n".join([
            "per_listener_settings false",
            f"listener {PORT} {ip}",
            "allow_anonymous false",
            f"password_file {pw}",
            f"acl_file {acl}",
            # Persistent sessions survive a broker restart (a fault of #11): saved on exit only.
            "persistence true",
            f"persistence_location {d}/",
            "autosave_interval 0",
            f"log_dest file {d / 'mosquitto.log'}",
            "log_type error",
            "log_type warning",
            "log_type notice", "log_type information",
            "max_inflight_messages 0",
            "max_queued_messages 100000",
            "set_tcp_nodelay true",
            f"user {user}",
            "",
        ])
    )
    for path in (pw, acl, conf):
        _own(path, uid, gid, 0o600)
    _own(d, uid, gid, 0o700)
    access = BrokerAccess(admin=creds["admin"], router=creds["router"], client=creds["client"],
                          workers={name: creds[f"w-{name}"] for name in workers})
    return launch_broker(net, router_host), access


def launch_broker(net: Network, router_host: str) -> subprocess.Popen[bytes]:
    """Start mosquitto with the run's configuration (written by ``start_broker``) and wait
    until it listens; also how a ``broker-restart`` fault brings it back."""
    d = net.run.dir / "broker"
    ip = net.ip_of(router_host)
    proc = net.spawn(router_host, [MOSQUITTO, "-c", str(d / "mosquitto.conf")], name=runstate.BROKER,
                     log=d / "stdout.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BuildError(f"mosquitto exited ({proc.returncode}): {(d / 'stdout.log').read_text()[-500:]}")
        with netns.entered(net.ns_of(router_host)):
            s = socket.socket()
        try:
            s.settimeout(0.2)
            s.connect((ip, PORT))
            return proc
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise BuildError("mosquitto did not start listening within 10 s")
