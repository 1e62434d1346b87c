"""``testbed serve``'s HTTP front end as a process of its own, unprivileged.

The orchestrator (root: it built the network and runs the delay line) starts it in the
client host's namespace with two descriptors: the listening socket, made in the machine's
namespace on ``127.0.0.1:PORT``, and one end of a socket pair (the *desk*) on which the
front end asks for the WAN delay line's statistics, which live in the root-only run folder.
It reads its configuration (which holds a broker credential), loads the tokenizer and opens
its output folder while still root, then becomes ``workers.run_as`` like the router and the
workers before it parses anything a client sends.

It writes every request it served to ``served.jsonl`` in the run's ``out/`` folder as the
request ends; the orchestrator reads that file back, validating every line, once the front
end has exited. It prints ``up`` on its standard output once it is serving, and stops (every
request still running ends as failed, "server stopped") on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import IO, Any

from aiohttp import web
from pydantic import ValidationError

from protocol.topics import Topics
from protocol.worker_config import BrokerInfo, Contract, RunAs, Scales, WorkerStats
from testbed.net.delayline_contract import DelayLineReport
from testbed.net.runstate import read_nofollow
from testbed.serve.app import OpenAiFront, Served
from testbed.serve.gateway import Gateway
from testbed.serve.guard import HEAD_TIMEOUT_S, MAX_CONNECTIONS, serve_guarded
from testbed.serve.prometheus import Pipelines, ServeMetrics
from testbed.serve.record import SERVED_FILE
from workers.privilege import Identity, OutDir, drop_privileges, no_new_privileges

# The desk's protocol: the front end sends ASK, the orchestrator answers with a 4-byte
# big-endian length and the report's JSON (length 0: no delay line, or no report yet).
ASK = b"?"
MAX_REPORT = 1 << 20


class FrontConfig(Contract):
    """What the orchestrator hands the front end (written 0600 in the run folder)."""

    run_id: str
    broker: BrokerInfo
    timeout_s: float  # a request without completion by then fails (real seconds)
    model_dir: str  # the tokenizer's
    served: Served
    scales: Scales
    pipelines: Pipelines
    stats_paths: dict[str, str]  # worker -> its statistics file (out/<role>/, readable by this one's group)
    out_dir: str  # its own folder (out/front/), owned by ``run_as``
    run_as: RunAs | None


def answer_desk(desk: socket.socket, report: Any) -> bool:
    """The orchestrator's side: answer one question on ``desk`` with ``report()`` (a
    ``DelayLineReport`` or None); False once the front end has closed its end."""
    if not desk.recv(1):
        return False
    r = report()
    body = r.model_dump_json().encode() if r is not None else b""
    desk.sendall(struct.pack(">I", len(body)) + body)
    return True


class _Desk:
    """The front end's side of the desk: one question at a time, from the metrics thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(2.0)

    def delayline(self) -> DelayLineReport | None:
        try:
            self.sock.sendall(ASK)
            (n,) = struct.unpack(">I", self._exactly(4))
            if n == 0 or n > MAX_REPORT:
                return None
            return DelayLineReport.model_validate_json(self._exactly(n))
        except (OSError, ValidationError, struct.error):
            return None

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("the orchestrator closed the desk")
            buf += chunk
        return buf


def _worker_stats(paths: dict[str, str]) -> dict[str, WorkerStats]:
    out: dict[str, WorkerStats] = {}
    for host, path in paths.items():
        with contextlib.suppress(OSError, ValidationError):
            out[host] = WorkerStats.model_validate_json(read_nofollow(Path(path)))
    return out


def _warm_up(tokenizer: Any) -> None:
    """Run once, while privileged, what imports modules on first use (chat templates compile
    with jinja2): the account the front end becomes may not read the Python it runs on."""
    tokenizer.encode("warm up", add_special_tokens=False)
    tokenizer.decode([0, 1], skip_special_tokens=True)
    if getattr(tokenizer, "chat_template", None):
        with contextlib.suppress(Exception):  # a template that fails fails its requests, later
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                          add_generation_prompt=True)


async def _serve(cfg: FrontConfig, listen: socket.socket, tokenizer: Any, desk: _Desk, records: IO[str]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(cfg.broker, Topics(cfg.run_id), cfg.timeout_s, records)  # its MQTT client needs the loop
    paths = cfg.stats_paths
    metrics = ServeMetrics(cfg.scales, cfg.pipelines, lambda: _worker_stats(paths), desk.delayline)
    app = OpenAiFront(gateway, tokenizer, cfg.served, metrics).app()
    # Everything the broker and the clients send is parsed without root.
    drop_privileges(Identity(cfg.run_as.uid, cfg.run_as.gid) if cfg.run_as else None)
    gc.collect()
    gc.freeze()  # the front end's clock timestamps tokens: no full collections over the imports
    await gateway.start()
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, keepalive_timeout=HEAD_TIMEOUT_S)
    await runner.setup()
    server, guard = await serve_guarded(runner, listen)  # a bounded number of connections, heads in time
    print("up", flush=True)
    try:
        await stop.wait()
    finally:
        # Requests still running end first (as failed: "server stopped"), so that their
        # streams close and the HTTP server's shutdown does not wait on them.
        server.close()
        await gateway.stop()
        await runner.cleanup()
        if guard.refused or guard.too_slow:
            print(f"front: closed {guard.refused} connection(s) past the limit of {MAX_CONNECTIONS} and "
                  f"{guard.too_slow} whose request head did not arrive within {HEAD_TIMEOUT_S:g} s",
                  file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    no_new_privileges()  # netns.spawn sets it before exec (threads start at import); this covers a start by hand
    ap = argparse.ArgumentParser(prog="python -m testbed.serve.front")
    ap.add_argument("config", type=Path)
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--desk-fd", type=int, required=True)
    args = ap.parse_args(argv)
    cfg = FrontConfig.model_validate_json(args.config.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    _warm_up(tokenizer)
    listen = socket.socket(fileno=args.listen_fd)
    desk = _Desk(socket.socket(fileno=args.desk_fd))
    records = os.fdopen(OutDir(cfg.out_dir).open(SERVED_FILE, "w"), "w")
    try:
        asyncio.run(_serve(cfg, listen, tokenizer, desk, records))
    except Exception as e:  # noqa: BLE001 - the orchestrator shows this log's tail
        print(f"front end: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
