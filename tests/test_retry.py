"""The replayer's retries: the backoff an agent's SDK waits, which failures are worth another
attempt, and how a retried request is recorded and counted."""

from __future__ import annotations

import pytest

from protocol.token_stream import TokenChunk
from testbed.analysis.metrics import request_rows, summarize
from testbed.deploy.run_record import ClientRecord
from testbed.load.retry import NO_RETRY, RetryPolicy, attempt_rid, retryable

from .conftest import run_cli_output


def test_backoff_doubles_up_to_its_cap_less_a_deterministic_jitter() -> None:
    p = RetryPolicy(retries=6, initial_s=0.5, max_s=8.0, jitter=0.25)
    for k, base in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0]):
        b = p.backoff_s("s1-t0", k)
        assert 0.75 * base <= b <= base, (k, b)
        assert b == p.backoff_s("s1-t0", k)  # the same request waits alike in every run
    assert len({p.backoff_s(f"r{i}", 0) for i in range(20)}) > 10  # requests do not retry in lockstep
    assert RetryPolicy(jitter=0.0).backoff_s("x", 1) == 1.0
    assert NO_RETRY.retries == 0
    for bad in ({"retries": -1}, {"initial_s": -0.1}, {"initial_s": 9.0}, {"jitter": 1.0}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_what_is_retried_is_what_a_retry_can_fix() -> None:
    for why in ("worker decode-b died (during fault kill@2:host=decode-b)", "KV transfer to decode-b: reset",
                "no plan: no live decode worker in datacenter b", "timed out after 600 s",
                "client rejected a token message: start: negative"):
        assert retryable(why), why
    for why in ("320 tokens of KV exceed decode-a's capacity of 300", "router rejected a request: prompt: empty",
                "decode-a rejected a command: rid: bad", "router down: not answered", "router stopped"):
        assert not retryable(why), why
    assert attempt_rid("s3-t1", 0) == "s3-t1" and attempt_rid("s3-t1", 2) == "s3-t1@retry2"


def test_a_retried_request_keeps_its_first_send_and_every_failed_attempt() -> None:
    rec = ClientRecord("q", prompt_len=10, max_new=2, sent=100.0)
    rec.attempt_sent = 100.0
    rec.accept(TokenChunk("q", 0, [7], "decode-b"), 100.5)
    rec.accept(TokenChunk("q", 0, [], "router", True, "worker decode-b died"), 101.0)
    assert rec.done and rec.error == "worker decode-b died"
    rec.retry(attempt_rid("q", 1), 101.0)
    assert not rec.done and len(rec.tokens) == 0 and rec.by_worker == {} and rec.last_rid == "q@retry1"
    rec.attempt_sent = 101.5
    rec.accept(TokenChunk("q@retry1", 0, [7, 8], "relay", True), 102.0)
    assert rec.ok and rec.sent == 100.0 and rec.workers == ["relay"]
    assert [(a.rid, a.sent, a.ended, a.error) for a in rec.retried] == [("q", 100.0, 101.0, "worker decode-b died")]

    plain = ClientRecord("p", prompt_len=10, max_new=2, sent=100.0, ended=101.0, done=True, tokens=[1, 2],
                         token_times=[100.2, 101.0])
    failed = ClientRecord("f", prompt_len=10, max_new=2, sent=100.0, done=True, error="router down: not answered")
    recs = {"q": rec, "p": plain, "f": failed}
    df = request_rows(recs, {}).set_index("rid")
    assert df.loc["q", "attempts"] == 2 and df.loc["q", "retried_errors"] == "worker decode-b died"
    assert df.loc["q", "ttft_s"] == pytest.approx(2.0)  # from the first send: the user waited through the retry
    s = summarize(df.reset_index(), [], recs=recs)
    assert (s.retried, s.failed_attempts) == (1, 1) and s.retry_share == pytest.approx(1 / 4)
    # Lost to failures: the failed request, and the retried one only if it missed the SLO (it met it).
    assert s.goodput_lost_rps == pytest.approx(1 / s.duration_s)


@pytest.mark.parametrize("args", [["--retries", "-1"], ["--retry-backoff", "9"]])
def test_retry_options_out_of_range_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # The simulator checks its inputs as the emulation does, without starting a fork server.
    code, _, err = run_cli_output(["run", "--engine", "sim", "--trace", "traces/agentic-quick.jsonl", *args], capsys)
    assert code == 2 and "--retr" in err, err
