"""``testbed serve``: the emulation behind an OpenAI-compatible API until Ctrl-C or SIGTERM.

It builds the network and starts broker, workers and router for one policy, exactly as a
replay does (``testbed.deploy.deployment``), then serves HTTP on ``127.0.0.1:PORT`` of the machine.
The listening socket is made in the machine's namespace, and the serving thread then enters
the client host's namespace: requests arrive on the machine's loopback and go on into the
emulated network from the client host in datacenter ``a``, where the replayer's would.

On stop, the served requests are saved as a run (``requests.csv``/``.parquet``,
``summary.json``, ``report.md``, plots) with the fidelity verdict, so what an external
client measured can be set beside the server's own view; then everything is torn down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from testbed.deploy.cluster import worker_roles
from testbed.deploy.deployment import Deployment
from testbed.deploy.dilation import emulation_plan
from testbed.deploy.emulation import EmulationPlan
from testbed.deploy.fidelity import format_verdict
from testbed.deploy.model_files import ensure_model
from testbed.deploy.run_record import ClientRecord
from testbed.errors import EXIT_INFIDELITY, InputError, Terminated, TestbedError
from testbed.net import netns
from testbed.outputs import new_run_dir
from testbed.policies.spec import PddSpec, PolicySpec
from testbed.scenario import Role, Scenario
from testbed.serve.app import OpenAiFront, Served
from testbed.serve.gateway import Gateway
from testbed.serve.prometheus import Pipelines, ServeMetrics
from testbed.serve.record import SERVED_FILE, save_served
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
    return emulation_plan(sc, wl, wl.specs(1.0), opts.dilation, opts.dtype)


class _Serving:
    """The serving thread: its own event loop, inside the client host's namespace."""

    def __init__(self, ns: str, sock: socket.socket, build: Callable[[], tuple[Gateway, web.Application]]) -> None:
        self.ns, self.sock, self.build = ns, sock, build
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.up = threading.Event()
        self.error: BaseException | None = None
        self.gateway: Gateway | None = None
        self.thread = threading.Thread(target=self._body, name="serve", daemon=True)

    def _body(self) -> None:
        try:
            with netns.entered(self.ns):
                asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported on the main thread
            self.error = e
        finally:
            self.up.set()

    async def _main(self) -> None:
        # aiomqtt connects from executor threads: those must be in the namespace too.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(2, initializer=netns.join, initargs=(self.ns,)))
        self.loop, self.stop_event = asyncio.get_running_loop(), asyncio.Event()
        gateway, app = self.build()
        self.gateway = gateway
        await gateway.start()
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, self.sock, shutdown_timeout=5.0, backlog=512).start()
        self.up.set()
        try:
            await self.stop_event.wait()
        finally:
            # Requests still running end first (as failed: "server stopped"), so that their
            # streams close and the HTTP server's shutdown does not wait on them.
            await gateway.stop()
            await runner.cleanup()

    def stop(self) -> None:
        if self.loop is not None and self.stop_event is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(15)


class HttpFrontDoor:
    """``serve``'s load driver: an OpenAI-compatible HTTP server whose requests enter the
    emulation from the client host, until Ctrl-C or SIGTERM; then the requests it served."""

    samples_memory = False

    def __init__(self, sc: Scenario, opts: ServeOptions, plan: EmulationPlan, sock: socket.socket, served: Served,
                 tokenizer: object, out: Path) -> None:
        self.sc, self.opts, self.plan, self.sock, self.served, self.tokenizer = sc, opts, plan, sock, served, tokenizer
        self.label, self.out = opts.policy.label, out

    def drive(self, dep: Deployment, begin: Callable[[float], None]) -> tuple[list[RequestSpec],
                                                                            dict[str, ClientRecord]]:
        sc, opts, cl = self.sc, self.opts, dep.cluster

        def build() -> tuple[Gateway, web.Application]:
            gw = Gateway(dep.client_broker, dep.topics, sc.workers.request_timeout_s * dep.dilation * 1.5,
                         self.out / SERVED_FILE)
            pipelines = Pipelines(worker_roles(sc), {w: sc.datacenter_of(w) for w in cl.workers},
                                  isinstance(opts.policy, PddSpec))
            metrics = ServeMetrics(self.plan.scales, pipelines, cl.worker_stats, dep.net.delayline_stats)
            return gw, OpenAiFront(gw, self.tokenizer, self.served, metrics).app()

        gc.collect()
        gc.freeze()  # the front end's clock measures: no full collections over torch and pandas
        serving = _Serving(dep.client_ns, self.sock, build)
        serving.thread.start()
        port = self.sock.getsockname()[1]
        begin(time.monotonic())
        try:
            serving.up.wait()
            if serving.error is not None:
                raise TestbedError(f"the front end did not start: {serving.error}")
            print(f"serving {self.served.model} with policy {self.served.policy} on http://{HOST}:{port}/v1 "
                  f"(run {dep.net.run.run_id}, client host {dep.client_host}); Ctrl-C stops and saves to {self.out}",
                  flush=True)
            while serving.thread.is_alive():
                serving.thread.join(0.5)
            if serving.error is not None:
                raise TestbedError(f"the front end stopped: {serving.error}")
        except (KeyboardInterrupt, Terminated) as e:  # how a server is stopped: save, then tear down
            print(f"\nstopping ({type(e).__name__})...", file=sys.stderr, flush=True)
        finally:
            serving.stop()
            self.sock.close()
        gw = serving.gateway
        return gw.served() if gw is not None else ([], {})


def run_serve(sc: Scenario, opts: ServeOptions) -> int:
    """Serve until interrupted; save the served requests; exit 0, or 3 when the fidelity
    verdict failed (unless ``allow_infidelity``)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(ensure_model(sc.model_dir()))
    if not (model_dir / "tokenizer_config.json").exists():
        raise InputError(f"{sc.source}: workers.model: {model_dir} has no tokenizer (tokenizer_config.json); "
                         "testbed serve needs one to turn text into tokens")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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
        run = dep.run(HttpFrontDoor(sc, opts, plan, sock, served, tokenizer, out))
    print(format_verdict(opts.policy.label, run.verdict))
    if not run.recs:
        print("no request was served: nothing saved")
    else:
        paths = save_served(out, sc, plan, opts.policy, run, f"http://{HOST}:{port}/v1")
        print(f"saved: {', '.join(str(p) for p in paths)}")
    if not run.verdict.passed and not opts.allow_infidelity:
        return EXIT_INFIDELITY
    return 0
