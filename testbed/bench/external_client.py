"""``testbed bench client``: a maintained OpenAI-compatible benchmark client (NVIDIA's aiperf)
replays a Mooncake trace against ``testbed serve``; its TTFT and TPOT are set beside the
server's records of the same requests (``testbed.serve.compare``).

The trace is handed to aiperf at the server's token scale and dilation, so aiperf sends
what the testbed's own replayer would: every length divided by the token scale (and
aiperf's prefix block of 512 tokens with it, so requests that share hash ids share
prompt text, and the prefix caches hit as in the trace), every timestamp multiplied by the
dilation (arrivals at the trace's emulated times). aiperf finds the model's tokenizer
through a private Hugging Face cache folder (it resolves a local tokenizer path through the
hub cache when offline), and never goes to the network.

aiperf is not a dependency of the testbed: ``make bench-client`` installs it into its own
virtual environment (``.venv-client``) and passes its path.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.errors import InputError, TestbedError
from testbed.serve.compare import load_aiperf, write_comparison
from testbed.traces import load_trace

AIPERF_BLOCK = 512  # aiperf's (and Mooncake's) prefix block for mooncake_trace
TOKENIZER_REPO = "pdd-testbed/tokenizer"  # the name aiperf is given; it lives only in our cache folder


@dataclass(frozen=True)
class ClientBenchOptions:
    aiperf: Path
    scenario: Path
    trace: Path
    policy: str = "pdd"
    token_scale: int = 16
    dilation: str | None = None
    limit: int | None = None
    out: Path = Path("runs/bench-client")


def scaled_trace(src: Path, dst: Path, token_scale: int, dilation: float, limit: int | None) -> int:
    """The Mooncake trace as aiperf must send it (see the module docstring); returns requests."""

    if load_trace(src, "auto", 1).format != "mooncake":
        raise InputError(f"{src}: aiperf replays Mooncake traces (JSON lines with hash_ids); see traces/README.md")
    if AIPERF_BLOCK % token_scale:
        raise InputError(f"--token-scale: must divide aiperf's block of {AIPERF_BLOCK} tokens, got {token_scale}")
    lines = [json.loads(x) for x in src.read_text().splitlines() if x.strip()][:limit]
    dst.write_text("".join(json.dumps({
        "timestamp": round(r["timestamp"] * dilation), "input_length": math.ceil(r["input_length"] / token_scale),
        "output_length": max(1, math.ceil(r["output_length"] / token_scale)), "hash_ids": r["hash_ids"],
    }) + "\n" for r in lines))  # fmt: skip
    return len(lines)


def tokenizer_cache(model_dir: Path, home: Path) -> str:
    """A Hugging Face cache folder holding the model's tokenizer as ``TOKENIZER_REPO``."""
    repo = home / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "config.json"):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return TOKENIZER_REPO


def _start_server(opts: ClientBenchOptions, out: Path) -> tuple[subprocess.Popen[str], str, float, list[str]]:
    cmd = [sys.executable, "-m", "testbed", "serve", "--scenario", str(opts.scenario), "--policy", opts.policy,
           "--port", "0", "--token-scale", str(opts.token_scale), "--out", str(out)]
    if opts.dilation:
        cmd += ["--dilation", opts.dilation]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    log: list[str] = []
    dilation = math.nan
    for line in proc.stdout:
        log.append(line)
        print("  serve: " + line, end="", flush=True)
        if "dilation D = " in line:
            dilation = float(line.split("dilation D = ")[1].split()[0])
        if line.startswith("serving "):
            return proc, line.split(" on ")[1].split()[0], dilation, log
    raise TestbedError(f"testbed serve exited before serving (rc {proc.wait()}):\n{''.join(log[-30:])}")


def _stop_server(proc: subprocess.Popen[str], log: list[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
    log.append(rest)
    for line in rest.splitlines():
        print("  serve: " + line, flush=True)
    return proc.returncode


def run_client_bench(opts: ClientBenchOptions, model_dir: Path) -> int:
    if not os.access(opts.aiperf, os.X_OK):
        raise InputError(f"--aiperf: {opts.aiperf} is not an executable (make bench-client installs aiperf)")
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    repo = tokenizer_cache(model_dir, out / "hf-cache")
    proc, url, dilation, log = _start_server(opts, out / "server")
    try:
        n = scaled_trace(opts.trace, out / "trace-for-aiperf.jsonl", opts.token_scale, dilation, opts.limit)
        cmd = [str(opts.aiperf), "profile", "--model", model_dir.name, "--tokenizer", repo,
               "--url", url.removesuffix("/v1"), "--endpoint-type", "completions", "--streaming",
               "--input-file", str(out / "trace-for-aiperf.jsonl"), "--custom-dataset-type", "mooncake_trace",
               "--fixed-schedule", "--isl-block-size", str(AIPERF_BLOCK // opts.token_scale),
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--artifact-dir", str(out / "aiperf"), "--ui-type", "simple"]
        print(f"aiperf: {n} requests of {opts.trace} at token scale {opts.token_scale}, timestamps x {dilation:g}; "
              f"log {out / 'aiperf.log'}", flush=True)
        env = {**os.environ, "HF_HOME": str(out / "hf-cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.monotonic()
        with open(out / "aiperf.log", "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
        print(f"aiperf exited {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        served = _stop_server(proc, log)
    if rc != 0:
        tail = (out / "aiperf.log").read_text()[-3000:]
        raise TestbedError(f"aiperf failed (exit {rc}); the end of {out / 'aiperf.log'}:\n{tail}")
    path = write_comparison(load_aiperf(out / "aiperf"), out / "server", out)
    print(path.read_text())
    print(f"written: {path}, {out / 'client_vs_server.csv'}; aiperf's own tables: {out / 'aiperf'}")
    return 0 if served == 0 else served
