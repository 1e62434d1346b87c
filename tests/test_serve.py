"""``testbed serve`` driven by the ``openai`` library: greedy tokens equal to the
single-process reference, usage counts, order, chat and text prompts, OpenAI-style 4xx
errors after which the server serves on, ``/metrics`` as Prometheus text, and a stop that
saves the served requests and leaves nothing behind.

One server (PDD, the default scenario at token scale 1, float64 as verify) serves every
test of this module; the last test stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from testbed.deploy.accounts import COMPONENTS
from testbed.net import netns, runstate
from testbed.serve.compare import server_view
from testbed.traces.workload import synth_tokens
from workers.model import ModelRunner, ensure_default_model
from workers.privilege import Identity

from .conftest import ROOT, assert_unprivileged

# One server for the module, whose later tests read what the earlier ones served: one worker of
# make test's parallel part holds the module.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
              pytest.mark.xdist_group("serve")]
openai = pytest.importorskip("openai")

MODEL = "pdd-tiny-llama-v2"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    run_id: str
    out: Path
    log: list[str]
    front_pid: int


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    out = tmp_path_factory.mktemp("serve") / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", "serve", "--policy", "pdd", "--port", "0", "--token-scale", "1",
         "--dilation", "2", "--dtype", "float64", "--allow-infidelity", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
    assert proc.stdout is not None
    log: list[str] = []
    deadline = time.monotonic() + 240
    run_id = url = ""
    front_pid = 0
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("serving "):
                url = line.split(" on ")[1].split()[0]
                run_id = line.split("(run ")[1].split(",")[0]
                front_pid = int(line.split("front end pid ")[1].split(")")[0])
                break
            assert time.monotonic() < deadline, "".join(log)
        assert url, f"testbed serve exited (rc={proc.wait()}):\n{''.join(log)}"
        yield Server(proc, url, run_id, out, log, front_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if run_id:
            runstate.destroy(run_id, [], [])


@pytest.fixture(scope="module")
def client(server: Server):  # noqa: ANN201 - openai.OpenAI
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(ensure_default_model(), "float64")


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_model())


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_streamed_completion_is_the_reference_in_order_with_usage(server: Server, client, reference,
                                                                  tokenizer) -> None:
    prompt = synth_tokens("serve-stream", 300)
    want = reference.reference(prompt, 40)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    content, usage = chunks[:-1], chunks[-1]
    assert len(content) == len(want)  # one chunk per token
    got = [tokenizer.convert_tokens_to_ids(c.choices[0].text) if c.choices[0].text else tokenizer.eos_token_id
           for c in content]
    assert got == want  # every token, in order
    assert [c.choices[0].finish_reason for c in content[:-1]] == [None] * (len(want) - 1)
    assert content[-1].choices[0].finish_reason in ("length", "stop")
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (300, len(want))
    assert len({c.id for c in chunks}) == 1


def test_text_and_chat_prompts_give_the_reference(server: Server, client, reference, tokenizer) -> None:
    text = "The testbed emulates two datacenters; decode moves across the WAN. " * 3
    want = reference.reference(tokenizer.encode(text, add_special_tokens=False), 24)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(text) and r.usage.completion_tokens == len(want)

    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is PDD?"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = reference.reference(list(ids), 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content


def test_ignore_eos_runs_to_max_tokens(server: Server, client) -> None:
    r = client.completions.create(model=MODEL, prompt=synth_tokens("serve-eos", 64), max_tokens=33,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 33 and r.choices[0].finish_reason == "length"


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_serves_on(server: Server, client) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * 32760, max_tokens=16)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0.7)
    with pytest.raises(openai.BadRequestError, match="n: one choice"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2)
    status, body = _post(server.url + "/completions", b'{"model": "pdd-tiny-llama-v2", "prompt": ')
    assert status == 400 and "JSON" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    status, body = _post(server.url + "/completions", json.dumps({"model": MODEL, "prompt": [9000]}).encode())
    assert status == 400 and "vocabulary" in body["error"]["message"]
    r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_a_client_that_goes_away_mid_stream_is_recorded_and_the_server_serves_on(server: Server, client) -> None:
    stream = client.completions.create(model=MODEL, prompt=synth_tokens("serve-gone", 32), max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices[0].text is not None
    stream.close()
    r = client.completions.create(model=MODEL, prompt="after a disconnect", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_models_health_and_metrics(server: Server, client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert [m.id for m in client.models.list()] == [MODEL]
    for i in range(2):  # requests of its own: the counters below hold whatever ran before too
        r = client.completions.create(model=MODEL, prompt=synth_tokens(f"serve-metrics-{i}", 48), max_tokens=4,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    done = {s.labels["outcome"]: s.value for s in families["testbed_requests"].samples if s.name.endswith("_total")}
    assert done.get("completed", 0) >= 2
    ttft = {s.name: s.value for s in families["testbed_time_to_first_token_seconds"].samples}
    assert ttft["testbed_time_to_first_token_seconds_count"] == done["completed"]
    assert sum(s.value for s in families["testbed_pipeline_requests"].samples if s.name.endswith("_total")) \
        == done["completed"]
    steps = {s.labels["worker"]: s.value for s in families["testbed_worker_steps"].samples}
    assert steps["prefill"] > 0
    assert {s.labels["direction"] for s in families["testbed_wan_bytes"].samples} == {"a->b", "b->a"}


def test_the_front_end_is_unprivileged_in_the_client_namespace(server: Server, client) -> None:
    """The process that parses HTTP is the front end's own account (``workers.run_as``:
    per-component), with no capabilities, in the client host's namespace, and still serves
    once it has dropped root."""
    first = runstate.Run.load(runstate.STATE_ROOT / server.run_id / "manifest.json").info["uids"]
    front = first + COMPONENTS.index("front")
    assert_unprivileged(server.front_pid, Identity(front, front))
    client_ns = f"/run/netns/pdd{server.run_id}-client"
    assert os.stat(f"/proc/{server.front_pid}/ns/net").st_ino == os.stat(client_ns).st_ino
    assert os.stat(f"/proc/{server.front_pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    r = client.completions.create(model=MODEL, prompt=synth_tokens("serve-nobody", 16), max_tokens=4)
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_stop_saves_the_served_requests_and_leaves_nothing(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        rest, _ = server.proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise AssertionError("testbed serve ignored SIGTERM for 120 s") from None
    log = "".join(server.log) + rest
    assert server.proc.returncode == 0, log
    rows = pd.read_csv(server.out / "requests.csv")
    gone = rows[~rows.ok]
    assert len(rows) >= 8 and list(gone.error) == ["the HTTP client disconnected"], log
    # The disconnect reached the emulation: the router ended the request on its workers.
    assert list(gone.router_error) == ["cancelled by the client: the HTTP client disconnected"], log
    # Each request was written as it ended (the front end keeps only those in flight).
    assert len((server.out / "served.jsonl").read_text().splitlines()) == len(rows)
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["trace"]["format"] == "openai-http" and summary["trace"]["requests"] == len(rows)
    # Its stamps (the host's monotonic clock) placed on the wall clock an external client reads.
    starts = server_view(server.out)[0].start
    assert len(starts) and all(abs(t - time.time()) < 900 for t in starts), list(starts)
    assert not [n for n in netns.list_namespaces() if n.startswith(f"pdd{server.run_id}-")]
    assert not (runstate.STATE_ROOT / server.run_id).exists()
