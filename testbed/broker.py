"""MQTT broker lifecycle: mosquitto started by the testbed inside the router's namespace.

A generated config binds one listener to the router host's emulated address only, with
per-run credentials (no anonymous access) and no persistence; nothing from a system-wide
mosquitto service is used.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import time

from testbed import netns
from testbed.errors import BuildError
from testbed.net.build import Network
from workers.contracts import BrokerInfo

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = "/usr/bin/mosquitto_passwd"
PORT = 1883


def start_broker(net: Network, router_host: str) -> tuple[subprocess.Popen[bytes], BrokerInfo]:
    d = net.run.dir / "broker"
    d.mkdir(exist_ok=True)
    user, password = f"pdd{net.run.run_id}", secrets.token_urlsafe(16)
    pw = d / "passwd"
    subprocess.run([MOSQUITTO_PASSWD, "-c", "-b", str(pw), user, password], check=True,
                   capture_output=True)
    pw.chmod(0o600)
    ip = net.ip_of(router_host)
    conf = d / "mosquitto.conf"
    conf.write_text(
        "\n".join([
            "per_listener_settings false",
            f"listener {PORT} {ip}",
            "allow_anonymous false",
            f"password_file {pw}",
            "persistence false",
            f"log_dest file {d / 'mosquitto.log'}",
            "log_type error",
            "log_type warning",
            "max_inflight_messages 0",
            "max_queued_messages 100000",
            "set_tcp_nodelay true",
            "user root",
            "",
        ])
    )
    proc = net.spawn(router_host, [MOSQUITTO, "-c", str(conf)], name="mosquitto", log=d / "stdout.log")
    info = BrokerInfo(host=ip, port=PORT, username=user, password=password)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BuildError(f"mosquitto exited ({proc.returncode}): {(d / 'stdout.log').read_text()[-500:]}")
        with netns.entered(net.ns_of(router_host)):
            s = socket.socket()
        try:
            s.settimeout(0.2)
            s.connect((ip, PORT))
            return proc, info
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise BuildError("mosquitto did not start listening within 10 s")
