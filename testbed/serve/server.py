"""``testbed serve``: the emulation behind an OpenAI-compatible API until Ctrl-C or SIGTERM.

It builds the network and starts broker, workers and router for one policy, exactly as a
replay does (``testbed.deploy.deployment``), then serves HTTP on ``127.0.0.1:PORT`` of the machine.
The listening socket is made in the machine's namespace and handed to the front end, a
process of its own in the client host's namespace that runs unprivileged
(``testbed.serve.front``): requests arrive on the machine's loopback and go on into the
emulated network from the client host in datacenter ``a``, where the replayer's would.

On stop, the served requests are saved as a run (``requests.csv``/``.parquet``,
``summary.json``, ``report.md``, plots) with the fidelity verdict, so what an external
client measured can be set beside the server's own view; then everything is torn down.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from testbed.deploy.cluster import worker_roles
from testbed.deploy.deployment import Deployment
from testbed.deploy.dilation import emulation_plan
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fidelity import format_verdict
from testbed.deploy.model_files import ensure_model
from testbed.deploy.run_record import ClientRecord
from testbed.errors import EXIT_INFIDELITY, InputError, Terminated, TestbedError
from testbed.load.trace_replay import probe_replay
from testbed.net import netns, runstate
from testbed.outputs import new_run_dir
from testbed.policies import PolicySpec, policy_class
from testbed.scenario import Role, Scenario
from testbed.serve.app import Served
from testbed.serve.front import FrontConfig, answer_desk
from testbed.serve.prometheus import Pipelines
from testbed.serve.record import SERVED_FILE, parse_served, save_served
from testbed.traces import load_trace
from testbed.traces.workload import RequestSpec

HOST = "127.0.0.1"  # never anything but the machine's loopback


@dataclass(frozen=True)
class ServeOptions:
    policy: PolicySpec
    port: int = 8000
    token_scale: int = 16
    dilation: float | str | None = None  # None: the scenario's
    shape_trace: Path = Path("traces/agentic-quick.jsonl")  # what --dilation auto calibrates on
    dtype: str | None = None
    impairment: str = "auto"
    model_name: str | None = None  # default: the model directory's name
    out: Path | None = None
    allow_infidelity: bool = False
    max_concurrency: int = 256  # requests at once; more get 429
    default_max_tokens: int = 1024  # a chat request's when it sets none


def listen(port: int) -> socket.socket:
    """The listening socket, in this (the machine's) namespace."""
    try:
        return socket.create_server((HOST, port), backlog=512, reuse_port=False)
    except OSError as e:
        raise InputError(f"--port: cannot listen on {HOST}:{port}: {e.strerror}") from e


def plan_for(sc: Scenario, opts: ServeOptions) -> EmulationPlan:
    """Scales and dilation; ``auto`` calibrates on the shape of ``opts.shape_trace``."""
    if opts.token_scale < 1:
        raise InputError(f"--token-scale: must be >= 1, got {opts.token_scale}")
    wl = load_trace(opts.shape_trace, "auto", opts.token_scale)
    return emulation_plan(sc, wl, wl.specs(1.0), opts.dilation, opts.dtype, replay=probe_replay)


class HttpFrontDoor:
    """``serve``'s load driver: an OpenAI-compatible HTTP server whose requests enter the
    emulation from the client host, until Ctrl-C or SIGTERM; then the requests it served.

    The server is a process of its own (``testbed.serve.front``), unprivileged; this side
    starts it, answers its questions about the delay line, stops it, and reads back (and
    validates) what it served."""

    samples_memory = False

    def __init__(self, sc: Scenario, opts: ServeOptions, plan: EmulationPlan, sock: socket.socket, served: Served,
                 model_dir: Path, out: Path) -> None:
        self.sc, self.opts, self.plan, self.sock, self.served = sc, opts, plan, sock, served
        self.model_dir, self.out = model_dir, out
        self.port = sock.getsockname()[1]

    def config(self, dep: Deployment) -> FrontConfig:
        sc, cl = self.sc, dep.cluster
        return FrontConfig(
            run_id=dep.net.run.run_id, broker=dep.client_broker,
            timeout_s=sc.workers.request_timeout_s * dep.dilation * 1.5, model_dir=str(self.model_dir),
            served=self.served, scales=self.plan.scales,
            pipelines=Pipelines(worker_roles(sc), {w: sc.datacenter_of(w) for w in cl.workers},
                                any(role == "relay-decode" for role, _ in policy_class(self.opts.policy).deploys)),
            stats_paths={h: c.stats_path for h, c in cl.workers.items() if c.stats_path},
            out_dir=str(cl.accounts.folder("front")), run_as=cl.accounts.of("front"),
        )  # fmt: skip

    def drive(self, dep: Deployment, begin: Callable[[float], None]) -> tuple[list[RequestSpec],
                                                                            dict[str, ClientRecord]]:
        run_dir = dep.net.run.dir
        cfg_path = run_dir / "front.cfg.json"
        runstate.write_private(cfg_path, self.config(dep).model_dump_json())  # holds a broker credential
        desk, theirs = socket.socketpair()
        front = dep.net.spawn(
            dep.client_host,
            [sys.executable, "-m", "testbed.serve.front", str(cfg_path), "--listen-fd", str(self.sock.fileno()),
             "--desk-fd", str(theirs.fileno())],
            name="front", log=run_dir / "front.log", pass_fds=(self.sock.fileno(), theirs.fileno()),
            stdout=subprocess.PIPE)
        theirs.close()
        self.sock.close()  # the front end's now
        threading.Thread(target=_answer, args=(desk, dep), name="desk", daemon=True).start()
        begin(time.monotonic())
        try:
            assert front.stdout is not None
            if front.stdout.readline().strip() != b"up":
                raise TestbedError(f"the front end did not start (exit {front.wait()}):\n"
                                   f"{dep.cluster.log_tail('front')}")
            print(f"serving {self.served.model} with policy {self.served.policy} on http://{HOST}:{self.port}/v1 "
                  f"(run {dep.net.run.run_id}, client host {dep.client_host}, front end pid {front.pid}); "
                  f"Ctrl-C stops and saves to {self.out}", flush=True)
            rc = front.wait()
            raise TestbedError(f"the front end stopped (exit {rc}):\n{dep.cluster.log_tail('front')}")
        except (KeyboardInterrupt, Terminated) as e:  # how a server is stopped: save, then tear down
            print(f"\nstopping ({type(e).__name__})...", file=sys.stderr, flush=True)
        finally:
            _stop(front)
            desk.close()
        path = dep.cluster.accounts.folder("front") / SERVED_FILE
        try:
            text = runstate.read_nofollow(path)
        except FileNotFoundError:
            return [], {}
        specs, recs = parse_served(text, str(path))
        self.out.mkdir(parents=True, exist_ok=True)
        runstate.write_private(self.out / SERVED_FILE, text)
        return specs, recs


def _answer(desk: socket.socket, dep: Deployment) -> None:
    """The desk: the delay line's statistics for the front end's ``/metrics``, until it closes."""
    with contextlib.suppress(OSError):
        while answer_desk(desk, dep.net.delayline_stats):
            pass


def _stop(front: subprocess.Popen[bytes]) -> None:
    """SIGTERM: the front end ends its requests and writes them; SIGKILL if it does not."""
    netns.stop_child(front, 30)
    if front.stdout is not None:
        front.stdout.close()


def run_serve(sc: Scenario, opts: ServeOptions) -> int:
    """Serve until interrupted; save the served requests; exit 0, or 3 when the fidelity
    verdict failed (unless ``allow_infidelity``)."""
    from transformers import AutoConfig

    model_dir = Path(ensure_model(sc.model_dir()))
    if not (model_dir / "tokenizer_config.json").exists():
        raise InputError(f"{sc.source}: workers.model: {model_dir} has no tokenizer (tokenizer_config.json); "
                         "testbed serve needs one to turn text into tokens")
    cfg = AutoConfig.from_pretrained(model_dir)
    served = Served(model=opts.model_name or model_dir.name, max_len=cfg.max_position_embeddings,
                    vocab=cfg.vocab_size, eos=cfg.eos_token_id, policy=opts.policy.label, created=int(time.time()),
                    max_concurrency=opts.max_concurrency, default_max_tokens=opts.default_max_tokens)
    sock = listen(opts.port)
    port = sock.getsockname()[1]
    plan = plan_for(sc, opts)
    print(plan.describe(sc), flush=True)
    out = opts.out or new_run_dir("serve")
    if not sc.hosts_with_role(Role.CLIENT):
        raise InputError(f"{sc.source}: scenario has no host with role client (the front end's host)")
    with Deployment(sc, opts.policy, emulation=plan, impairment=opts.impairment, dtype=opts.dtype) as dep:
        run = dep.run(HttpFrontDoor(sc, opts, plan, sock, served, model_dir, out))
    print(format_verdict(opts.policy.label, run.verdict))
    if not run.recs:
        print("no request was served: nothing saved")
    else:
        paths = save_served(out, sc, plan, opts.policy, run, f"http://{HOST}:{port}/v1")
        print(f"saved: {', '.join(str(p) for p in paths)}")
    if not run.verdict.passed and not opts.allow_infidelity:
        return EXIT_INFIDELITY
    return 0
