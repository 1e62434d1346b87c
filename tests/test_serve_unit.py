"""The pieces of ``testbed serve`` that need no network: the character tokenizer's
guarantees, the OpenAI request validation, pipeline names, the aiperf trace and the
client-vs-server comparison."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from testbed.bench.external_client import scaled_trace
from testbed.deploy.run_record import ClientRecord
from testbed.errors import InputError
from testbed.serve.compare import ClientRecords, comparison, load_aiperf
from testbed.serve.openai_api import ChatCompletionRequest, CompletionRequest
from testbed.serve.prometheus import Pipelines
from workers.tokenizer import build_tokenizer, vocabulary


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return build_tokenizer(8192, 32768)


def test_equal_text_prefixes_give_equal_token_prefixes(tok) -> None:
    rng = random.Random(3)
    alphabet = "ab \n\t.,中国xyz<|>"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        cut = rng.randint(0, len(text))
        whole, head = tok.encode(text, add_special_tokens=False), tok.encode(text[:cut], add_special_tokens=False)
        assert whole[: len(head)] == head and len(whole) == len(text)


def test_every_generated_id_is_text_that_encodes_back_to_it(tok) -> None:
    ids = list(range(3, 8192))
    text = tok.decode(ids)
    assert len(text) == len(ids) and tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode([5, 2, 6], skip_special_tokens=True) == tok.decode([5, 6])  # eos is no text
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    typed = tok.encode("a</s>b", add_special_tokens=False)  # special tokens' text is plain text
    assert tok.eos_token_id not in typed and typed[:3] == tok.encode("a</", add_special_tokens=False)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    with pytest.raises(ValueError, match="character vocabulary"):
        vocabulary(50)


def test_a_conversation_is_a_prefix_of_its_next_turn(tok) -> None:
    turn1 = [{"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "more"}]
    first = tok.apply_chat_template(turn1, tokenize=True, add_generation_prompt=False)
    second = tok.apply_chat_template(turn2, tokenize=True, add_generation_prompt=True)
    assert second[: len(first)] == first


@pytest.mark.parametrize(("body", "error"), [
    ({"temperature": 0.5}, "temperature: only greedy"),
    ({"n": 2}, "n: one choice"),
    ({"stop": ["\n"]}, "stop: stop strings"),
    ({"logprobs": 3}, "logprobs"),
    ({"frobnicate": 1}, "frobnicate: unsupported parameter"),
    ({"max_tokens": 0}, "greater than or equal to 1"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": ""}, "the prompt is empty"),
])  # fmt: skip
def test_unsupported_or_invalid_parameters_are_refused_by_name(body: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **body})


def test_neutral_values_and_no_effect_fields_are_accepted() -> None:
    r = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]], "n": 1, "stop": [], "top_p": 1.0,
                                          "user": "u", "seed": 3, "temperature": 0, "stream": True,
                                          "stream_options": {"include_usage": True}, "ignore_eos": True})
    assert r.prompt == [5, 6] and r.include_usage and r.ignore_eos
    c = ChatCompletionRequest.model_validate({"model": "m", "max_completion_tokens": 7, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert c.max_new == 7 and c.messages[0].text == "ab"


def test_pipelines_are_named_as_the_router_names_them() -> None:
    roles = {"relay": "relay-decode", "decode-a": "decode", "decode-b": "decode"}
    dcs = {"relay": "a", "decode-a": "a", "decode-b": "b"}

    def rec(*workers: str) -> ClientRecord:
        r = ClientRecord("r", 1, 1)
        r.workers = list(workers)
        return r

    pdd, classic = Pipelines(roles, dcs, True), Pipelines(roles, dcs, False)
    assert pdd.of(rec("relay", "decode-b")) == "P-RLD-MD" and pdd.of(rec("relay")) == "P-RLD"
    assert pdd.of(rec("decode-b")) == "P-MD" and classic.of(rec("decode-b")) == "P-D(b)"
    assert classic.of(rec("decode-a")) == "P-D(a)"


def test_the_trace_aiperf_sends_keeps_emulated_lengths_and_times(tmp_path: Path) -> None:
    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                       "hash_ids": list(range(-(-n // 512)))}) + "\n"
                           for t, n, o in [(0, 1030, 40), (500, 512, 7), (900, 2000, 300)]))
    dst = tmp_path / "a.jsonl"
    assert scaled_trace(src, dst, 16, 2.5, None) == 3
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0, 1250, 2250]
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(65, 3), (32, 1), (125, 19)]
    assert rows[0]["hash_ids"] == [0, 1, 2]
    assert scaled_trace(src, dst, 16, 1.0, 2) == 2
    with pytest.raises(InputError, match="must divide"):
        scaled_trace(src, dst, 3, 1.0, None)
    other = tmp_path / "s.jsonl"
    turns = [{"new_tokens": 5, "output_tokens": 2}]
    other.write_text(json.dumps({"session": "s", "start_s": 0, "turns": turns}) + "\n")
    with pytest.raises(InputError, match="Mooncake"):
        scaled_trace(other, dst, 16, 1.0, None)


def test_client_and_server_views_are_compared_in_real_units(tmp_path: Path) -> None:
    export = tmp_path / "profile_export.jsonl"
    starts = [100.0 + i for i in range(5)]
    export.write_text("".join(json.dumps({
        "metadata": {"request_start_ns": int(s * 1e9), "benchmark_phase": "profiling"},
        "metrics": {"time_to_first_token": {"value": 110.0 + i, "unit": "ms"},
                    "inter_token_latency": {"value": 50.0, "unit": "ms"},
                    "output_sequence_length": {"value": 8, "unit": "tokens"}}}) + "\n"
        for i, s in enumerate(starts)) + json.dumps({"metadata": {"request_start_ns": 1}, "metrics": {}}) + "\n")
    client = load_aiperf(tmp_path)
    assert len(client.frame) == 5  # the failed one (no first token) left out
    # The server saw each request 2 ms after the client sent it and its first token 5 ms before
    # the client did: TTFT 103 + i ms real; 50 ms per real token = 50 / (2 x 4) per emulated one.
    server = pd.DataFrame({"start": [s + 0.002 for s in starts], "ttft_s": [0.103 + i / 1000 for i in range(5)],
                           "itl_s": [0.050] * 5, "output_tokens": [8] * 5})
    text, pairs = comparison(client, server, 2.0, 4)
    assert len(pairs) == 5
    assert np.allclose(pairs.ttft_s_client - pairs.ttft_s_server, 0.007)
    assert "| TTFT P50 | 112.0 | 105.0 | +7.0 (+6.7%) | +7.0 |" in text
    assert "TPOT P50 6.25 per emulated token" in text
    with pytest.raises(InputError, match="no aiperf"):
        load_aiperf(tmp_path / "missing")
    assert isinstance(client, ClientRecords)


def test_served_records_are_validated_as_input_when_read_back() -> None:
    """The front end that wrote ``served.jsonl`` parsed what clients sent: its file is read
    back like any other input, an error naming the line."""
    import io

    from testbed.errors import TestbedError
    from testbed.serve.record import parse_served, write_served
    from testbed.traces.workload import RequestSpec

    buf = io.StringIO()
    for rid in ("cmpl-a", "cmpl-b"):
        rec = ClientRecord(rid, 5, 2, sent=1.0, ended=2.0, token_times=[1.5, 2.0], tokens=[7, 8], done=True)
        write_served(buf, RequestSpec(rid=rid, prompt=[], max_new=2, at=0.5), rec)
    specs, recs = parse_served(buf.getvalue(), "served.jsonl")
    assert [s.rid for s in specs] == ["cmpl-a", "cmpl-b"] and list(recs["cmpl-b"].tokens) == [7, 8]
    lines = buf.getvalue().splitlines()
    with pytest.raises(TestbedError, match=r"served.jsonl:2: .*prompt_len"):
        parse_served(lines[0] + "\n" + lines[1].replace('"prompt_len":5', '"prompt_len":"many"'), "served.jsonl")
    with pytest.raises(TestbedError, match=r"served.jsonl:2: rid: cmpl-a was already served"):
        parse_served(lines[0] + "\n" + lines[0], "served.jsonl")
    with pytest.raises(TestbedError, match=r"served.jsonl:1: "):
        parse_served('{"rid": 1}', "served.jsonl")
