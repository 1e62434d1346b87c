"""The hostile-component suite, live (root): a component that was taken over keeps its own
account and credentials, and with them affects no other worker's requests.

A rogue holds decode-a's broker credential and the run's KV token (everything that worker's
configuration gives it) and, from decode-a's host while PDD requests run on prefill, relay
and decode-b, tries what a compromised worker would: declare decode-b dead, fail and cancel
requests it was not given, stream tokens into them, feed decode-b and the relay handoff
messages, offer decode-b KV under each request's exact prompt (it lacks only the request's
ticket), and send every reader payloads that parsers choke on. Every
request completes with the reference tokens, no process ends, and each refusal is a line in
the refusing process's log; the rogue's account can neither signal the router nor touch
another component's folder. The rest of the suite (``make test-hostile``: the ``hostile``
marker) covers the other accounts: a rogue HTTP client (``test_serve_bounds``), a rogue KV
peer without the token (``test_kv_wire_bounds``), a rogue broker account and links planted
where root reads (``test_broker``, ``test_privilege``), and hostile input at every parser
(``test_hostile_input``, ``test_contracts``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import torch

from protocol import token_stream
from protocol.messages import QOS, CancelCmd, ExtendCmd, Failed, HandoffAck, Status
from protocol.token_stream import TokenChunk
from protocol.worker_config import KV_PORT
from testbed.deploy.cluster import Cluster
from testbed.deploy.deployment import Deployment
from testbed.load.trace_replay import TraceReplay
from testbed.load.verify import compare, verification_prompts
from testbed.net import netns
from testbed.policies import parse_policy
from workers import kv_wire
from workers.model import ModelRunner, ensure_default_model

from .conftest import needs_root, scenario_with
from .test_contracts import HOSTILE_PAYLOADS

pytestmark = [needs_root, pytest.mark.hostile]
ROGUE = "decode-a"  # PDD's plans here use prefill, relay and decode-b: decode-a is in none


async def _act(cl: Cluster, victims: dict[str, list[int]], shape: kv_wire.ModelShape) -> dict[str, Any]:
    """Everything the rogue tries, with decode-a's credential and KV token and each victim's
    prompt; what came back."""
    t, b = cl.topics, cl.access.workers[ROGUE]
    seen: dict[str, Any] = {}
    async with aiomqtt.Client(b.host, b.port, username=b.username, password=b.password,
                              identifier=f"{t.root}-rogue") as c:

        async def pub(topic: str, payload: bytes) -> None:
            await c.publish(topic, payload, qos=QOS)

        dead = Status(worker="decode-b", role="decode", state="dead").dump()
        await pub(t.status(ROGUE), dead)  # its own topic, another's name
        await pub(t.status("decode-b"), dead)  # another's topic: the broker drops it
        for v in victims:
            await pub(t.events(ROGUE), Failed(rid=v, worker=ROGUE, t=1.0, reason="rogue").dump())
            await pub(t.events(ROGUE), Failed(rid=v, worker="decode-b", t=1.0, reason="rogue as decode-b").dump())
            await pub(t.cmd("decode-b"), CancelCmd(rid=v).dump())  # the router's topic: dropped
            await pub(t.peer("decode-b", ROGUE), CancelCmd(rid=v).dump())
            await pub(t.peer("decode-b", ROGUE), ExtendCmd(rid=v, start=0, tokens=[1], final=True).dump())
            await pub(t.peer("relay", ROGUE), HandoffAck(rid=v, extended=0).dump())
        chunks = [TokenChunk(v, 0, [7, 7, 7], ROGUE) for v in victims]
        chunks.append(TokenChunk(next(iter(victims)), 3, [], ROGUE, done=True, error="rogue says it failed"))
        batch = token_stream.encode(ROGUE, time.time(), chunks)
        await pub(t.stream(ROGUE), batch)
        await pub(t.stream(ROGUE), batch[:-2])  # malformed, after naming every victim
        for payload in HOSTILE_PAYLOADS:
            for topic in (t.events(ROGUE), t.status(ROGUE), t.stream(ROGUE), t.peer("decode-b", ROGUE),
                          t.peer("relay", ROGUE)):
                await pub(topic, payload)
    # KV: the run's token, a request decode-b waits for, its exact prompt; no ticket (the router
    # gives each request's ticket to its prefill and decoder alone).
    host, token = cl.workers["decode-b"].host_ip, cl.workers[ROGUE].kv_token

    async def offer(v: str) -> None:
        n = len(victims[v])
        kv = torch.zeros(shape.layers, 2, shape.kv_heads, n, shape.head_dim, dtype=shape.dtype)
        try:
            await kv_wire.send_kv(host, KV_PORT, v, list(victims[v]), kv, 1, cl.workers[ROGUE].block_size,
                                  token=token, timeout_s=10.0)
            seen.setdefault("kv_served", []).append(v)
        except kv_wire.KVTransferError as e:
            seen.setdefault("kv_refused", []).append(str(e))

    await asyncio.gather(*(offer(v) for v in victims))
    # And a stranger's bytes, no token.
    with socket.create_connection((host, KV_PORT), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        s.settimeout(10)
        answer = b""
        while part := s.recv(4096):  # told why, then closed
            answer += part
        seen["stranger"] = answer
    return seen


def _rogue(cl: Cluster, victims: dict[str, list[int]], shape: kv_wire.ModelShape,
           out: dict[str, Any]) -> threading.Thread:
    ns = cl.net.ns_of(ROGUE)
    process = next(p for p in cl.net.run.processes if p.name == f"worker-{ROGUE}")

    def run() -> None:
        # The rogue is decode-a taken over: its credential's client id is its account's name
        # (the broker sets it), so the rogue speaks as decode-a and no one else; the worker it
        # replaced is gone (a second connection under that id would take turns with it).
        os.kill(process.pid, signal.SIGKILL)
        with netns.entered(ns):
            try:
                out.update(asyncio.run(_act(cl, victims, shape)))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                out["error"] = repr(e)

    return threading.Thread(target=run, daemon=True)


def _tries_as(ident: Any, attempts: dict[str, Any]) -> dict[str, str]:
    """Each attempt, in a child that became ``ident``: what it raised ("ok" if nothing)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        out = {}
        try:
            os.setgroups([])
            os.setresgid(ident.gid, ident.gid, ident.gid)
            os.setresuid(ident.uid, ident.uid, ident.uid)
            for name, fn in attempts.items():
                try:
                    fn()
                    out[name] = "ok"
                except OSError as e:
                    out[name] = type(e).__name__
        finally:
            os.write(w, json.dumps(out).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_a_rogue_worker_account_affects_no_other_workers_requests() -> None:
    specs = [replace(s, at=0.3 * i, max_new=48) for i, s in enumerate(verification_prompts(12, seed=8, max_len=512))]
    runner = ModelRunner(ensure_default_model(), "float64")
    refs = {s.rid: runner.reference(s.prompt, s.max_new) for s in specs}
    victims = {s.rid: list(s.prompt) for s in specs}
    out: dict[str, Any] = {}
    with Deployment(scenario_with(), parse_policy("pdd:relay_s=0"), dtype="float64") as dep:
        cl = dep.cluster
        rogue = _rogue(cl, victims, runner.shape, out)
        _, recs = TraceReplay(specs, timeout_s=120).drive(dep, lambda t0: threading.Timer(1.2, rogue.start).start())
        rogue.join(60)
        alive = {p.name: netns.is_alive(p.pid, p.starttime) for p in cl.net.run.processes
                 if (p.name.startswith("worker") and p.name != f"worker-{ROGUE}") or p.name in ("router", "mosquitto")}
        alive["router"] = cl.router.poll() is None
        deaths = cl.worker_deaths()
        # The rogue's own account (decode's) against the router and another role's folder.
        decode, router_pid = cl.workers[ROGUE].run_as, cl.router.pid

        def create(path: Path) -> None:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))

        tried = _tries_as(decode, {
            "signal the router": lambda: os.kill(router_pid, 0),
            "append to its records": lambda: os.close(os.open(cl.records_path, os.O_WRONLY | os.O_APPEND)),
            "list its folder": lambda: os.listdir(cl.accounts.folder("router")),
            "write in prefill's": lambda: create(cl.accounts.folder("prefill") / "x"),
            "write its own": lambda: create(cl.accounts.folder("decode") / "x"),
        })
        logs = {name: cl.log_tail(name, 200_000) for name in ("router", "worker-decode-b", "worker-relay", "client")}
        router = cl.router_records()
    assert "error" not in out, out
    assert compare(specs, refs, recs) == [], {rid: r.error for rid, r in recs.items()}
    assert {router[s.rid].pipeline for s in specs} == {"P-RLD-MD"}  # decode-a was in no plan
    assert all(alive.values()) and len(alive) >= 4, alive  # no process ended but the one the rogue replaced
    assert {d.worker for d in deaths} <= {ROGUE}, deaths
    assert tried == {"signal the router": "PermissionError", "append to its records": "PermissionError",
                     "list its folder": "PermissionError", "write in prefill's": "PermissionError",
                     "write its own": "ok"}, tried
    # Each refusal, in the refusing process's log.
    r = logs["router"]
    assert f"refused a message on {cl.topics.status(ROGUE)} claiming to be 'decode-b'" in r
    assert "claiming to be 'decode-b' (for" in r and "from decode-a, not a worker of its plan" in r
    d = logs["worker-decode-b"]
    assert "decode-b: refused a cancel for" in d and "a peer decoder sends only extend and handoff_ack" in d
    assert "decode-b: refused a message from decode-a" in d  # a hostile payload, not parsed
    # Refused whatever state each request was in at decode-b: not commanded yet, waiting for
    # its KV (the rogue's HELLO has its exact prompt but not its ticket), decoding, or ended.
    # The victims that arrive within the HELLO's wait for a command (2 s; they come every
    # 0.3 s from before the rogue starts until 2 s after) are refused for the ticket.
    assert len(out["kv_refused"]) == len(victims) and "kv_served" not in out, out
    reasons = ("does not carry the ticket", "no command for it", "no longer waiting", "already ended")
    assert all(any(why in r for why in reasons) for r in out["kv_refused"]), out["kv_refused"]
    assert any("does not carry the ticket" in r for r in out["kv_refused"]), out["kv_refused"]
    assert "decode-b: refused KV for" in d and "its HELLO does not carry the request's ticket" in d
    assert "KV: refused a connection from" in d and b"refused" in out["stranger"]
    c = logs["client"]  # the replay client, a process of its own
    assert "client: refused tokens for" in c and "from decode-a: not a worker the router named" in c
    for name, text in logs.items():
        assert "Traceback" not in text, (name, text[-3000:])
