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
root for its own user once its listener is bound. It can write only its persistent
sessions: its configuration, password file, ACL and log are root's, written again before
every launch (``BrokerFiles``).
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

from protocol.messages import MAX_MESSAGE_BYTES
from protocol.topics import Topics
from protocol.worker_config import BrokerInfo
from testbed.errors import BuildError
from testbed.net import netns, runstate
from testbed.net.build import Network

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = "/usr/bin/mosquitto_passwd"
MOSQUITTO_USER = "mosquitto"  # created by the Debian package
PORT = 1883  # the components' listener: a client id is its account's name (nothing else)
CLIENT_PORT = 1884  # the orchestrator's and load drivers' listener: ids of their own choosing
COMPONENTS = ("router",)  # principals besides the workers ("w-<name>") that connect on PORT
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
        "router": [("read", t.requests), ("read", t.cancels), ("read", t.all_events), ("read", t.all_status),
                   ("write", t.cmd("+")), ("write", t.all_tokens), ("readwrite", t.router_status)],
        "client": [("write", t.requests), ("write", t.cancels), ("read", t.all_streams), ("read", t.all_tokens),
                   ("read", t.router_status)],
    }
    for name, role in sorted(workers.items()):
        mine = [("read", t.cmd(name)), ("readwrite", t.status(name)), ("write", t.events(name)),
                ("write", t.stream(name))]
        if role in DECODERS:  # the handoff: each writes to the others under its own name
            mine += [("read", t.peers_of(name))]
            mine += [("write", t.peer(peer, name)) for peer, r in sorted(workers.items())
                     if r in DECODERS and peer != name]
        rules[f"w-{name}"] = mine
    return rules


def acl_text(run_id: str, rules: dict[str, list[tuple[str, str]]]) -> str:
    lines = []
    for principal, rs in rules.items():
        lines.append(f"user {run_id}-{principal}")
        lines += [f"topic {access} {topic}" for access, topic in rs]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class BrokerFiles:
    """What mosquitto is started on, kept by the orchestrator and written again, root-owned,
    before every launch (the first and each ``broker-restart``): a broker account that
    rewrote its configuration (``user root``) would otherwise be started as root on it.

    Two folders: ``broker/`` (root, group mosquitto, 0750) holds the configuration
    (root 0600: read by mosquitto while still root), the password file and the ACL (root,
    group mosquitto, 0640: mosquitto reads both after it has dropped root) and mosquitto's
    log, which root opens as its standard output; ``broker-state/`` (mosquitto, 0700) holds only
    the persistent sessions, the one thing the broker writes."""

    conf: str
    passwd: dict[str, str]  # file name -> its text, hashed by mosquitto_passwd (one per listener)
    acl: dict[str, str]  # file name -> its rules (one per listener)

    @staticmethod
    def conf_path(run: runstate.Run) -> Path:
        return run.dir / "broker" / "mosquitto.conf"

    @staticmethod
    def log_path(run: runstate.Run) -> Path:
        return run.dir / "broker" / "mosquitto.log"

    def write(self, run: runstate.Run) -> None:
        mosq = _mosquitto_ids()
        conf_dir = run.folder_for("broker", 0, mosq[1] if mosq else 0, 0o750)
        run.folder_for("broker-state", *(mosq or (0, 0)))
        runstate.write_private(self.conf_path(run), self.conf)
        for name, text in (*self.passwd.items(), *self.acl.items()):
            path = conf_dir / name
            runstate.write_private(path, text)
            if mosq:
                os.chown(path, 0, mosq[1])
                path.chmod(0o640)


def _mosquitto_ids() -> tuple[int, int] | None:
    """The broker account's uid and gid (None: no such account, mosquitto stays root)."""
    try:
        owner = pwd.getpwnam(MOSQUITTO_USER)
    except KeyError:
        return None
    return owner.pw_uid, owner.pw_gid


def start_broker(net: Network, router_host: str, workers: dict[str, str]) -> tuple[subprocess.Popen[bytes],
                                                                                    BrokerAccess, BrokerFiles]:
    conf_dir, state_dir = net.run.folder_for("broker", 0, 0), net.run.dir / "broker-state"
    user = MOSQUITTO_USER if _mosquitto_ids() else "root"  # no such user (not a Debian package): stays root
    topics = Topics(net.run.run_id)
    rules = acl_rules(topics, workers)
    ip = net.ip_of(router_host)
    # Two listeners, each with its own accounts: on PORT the components, whose client id the
    # broker sets to their account's name (``use_username_as_clientid``), so that no
    # credential can connect under another component's id (MQTT would hand it that session:
    # the victim disconnected, its will published, its queued commands delivered to the
    # impostor); on CLIENT_PORT the orchestrator and the load drivers, which open several
    # connections under one account with ids of their own. A component's account does not
    # exist on the clients' listener, nor a client's on the components'.
    component = {p for p in rules if p in COMPONENTS or p.startswith("w-")}
    creds = {p: BrokerInfo(host=ip, port=PORT if p in component else CLIENT_PORT, username=f"{net.run.run_id}-{p}",
                           password=secrets.token_urlsafe(16)) for p in rules}
    groups = {"": component, "-clients": set(rules) - component}
    passwd = {f"passwd{g}": _hashed(conf_dir, [creds[p] for p in rules if p in members])
              for g, members in groups.items()}
    acl = {f"acl{g}": acl_text(net.run.run_id, {p: r for p, r in rules.items() if p in members})
           for g, members in groups.items()}
    conf = "\n".join([
        "per_listener_settings true",
        f"listener {PORT} {ip}",
        "allow_anonymous false",
        "use_username_as_clientid true",
        f"password_file {conf_dir / 'passwd'}",
        f"acl_file {conf_dir / 'acl'}",
        f"listener {CLIENT_PORT} {ip}",
        "allow_anonymous false",
        f"password_file {conf_dir / 'passwd-clients'}",
        f"acl_file {conf_dir / 'acl-clients'}",
        # Persistent sessions survive a broker restart (a fault of #11): saved on exit only.
        "persistence true",
        f"persistence_location {state_dir}/",
        "autosave_interval 0",
        # To standard error, which root opened in the root-owned folder: a log file that
        # mosquitto opened by name would be one in a folder it can write.
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice", "log_type information",
        "max_inflight_messages 0",
        "max_queued_messages 100000",
        f"message_size_limit {MAX_MESSAGE_BYTES}",
        "set_tcp_nodelay true",
        f"user {user}",
        "",
    ])
    files = BrokerFiles(conf, passwd, acl)
    access = BrokerAccess(admin=creds["admin"], router=creds["router"], client=creds["client"],
                          workers={name: creds[f"w-{name}"] for name in workers})
    return launch_broker(net, router_host, files), access, files


def _hashed(conf_dir: Path, creds: list[BrokerInfo]) -> str:
    """A password file's text: plain "user:password" lines hashed in place by
    ``mosquitto_passwd -U`` in a root-only temporary; the hashed text is what every launch
    writes."""
    plain = conf_dir / ".passwd.plain"
    runstate.write_private(plain, "".join(f"{c.username}:{c.password}\n" for c in creds))
    try:
        subprocess.run([MOSQUITTO_PASSWD, "-U", str(plain)], check=True, capture_output=True)
        return runstate.read_nofollow(plain)
    finally:
        plain.unlink(missing_ok=True)


def launch_broker(net: Network, router_host: str, files: BrokerFiles) -> subprocess.Popen[bytes]:
    """Write the broker's files again (``BrokerFiles``), start mosquitto on them and wait
    until it listens; also how a ``broker-restart`` fault brings it back."""
    files.write(net.run)
    ip = net.ip_of(router_host)
    log = BrokerFiles.log_path(net.run)
    proc = net.spawn(router_host, [MOSQUITTO, "-c", str(BrokerFiles.conf_path(net.run))], name=runstate.BROKER,
                     log=log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BuildError(f"mosquitto exited ({proc.returncode}): {runstate.read_nofollow(log)[-500:]}")
        with netns.entered(net.ns_of(router_host)):
            s = socket.socket()
        try:
            s.settimeout(0.2)
            s.connect((ip, CLIENT_PORT))  # the second listener: both are open
            return proc
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise BuildError("mosquitto did not start listening within 10 s")
