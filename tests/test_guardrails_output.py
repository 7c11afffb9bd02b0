"""The output direction of guardrails: whole answers and streams, through the gateway with the openai
client. The echo engine says what it is told (`echo: <text>`), and with `echo_piece_chars` streams it
in pieces of that many characters, so a match can be split across chunks."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis

from examlops_testsupport.fixtures import RedisServer, Stack, free_port
from examlops_testsupport.guardrails import (
    ADMIN,
    blocked,
    client,
    guardrail,
    issue_key,
    register_echo,
    set_policy,
    stream_text,
)

EMAIL = "carol.jones@example.com"
SAY = f"reach me at {EMAIL} after lunch"


def _key(stack: Stack, model: str, policy: str, *groups: str) -> openai.OpenAI:
    register_echo(stack, model)
    set_policy(stack, policy, *groups)
    return client(stack, issue_key(stack, model, policy))


def _endpoint(stack: Stack, model: str, policy: str, *groups: str) -> openai.OpenAI:
    """The admin key (the only one that may send echo's test field) on an endpoint the policy is attached to."""
    register_echo(stack, model)
    set_policy(stack, policy, *groups)
    guardrail(stack, "attach", policy, "--model", model)
    return client(stack, ADMIN["Authorization"].split()[1])


def _engine_pieces(say: str, piece: int) -> list[str]:
    text = f"echo: {say}"
    return [text[i:i + piece] for i in range(0, len(text), piece)]


def _pii_out(action: str) -> tuple[str, ...]:
    return ("--detector", "pii", "--entities", "EMAIL_ADDRESS", "--direction", "output", "--action", action)


def _usage(stack: Stack, c: openai.OpenAI) -> dict[str, object]:
    key_id = c.api_key.split("-")[2]
    row: dict[str, object] = httpx.get(f"{stack.gateway_url}/admin/keys/{key_id}", headers=ADMIN).json()
    return row


def test_a_whole_answer_is_redacted_blocked_or_logged(stack: Stack) -> None:
    red = _key(stack, "g-out-whole", "out-redact", *_pii_out("redact"))
    resp = red.chat.completions.with_raw_response.create(model="g-out-whole",
                                                         messages=[{"role": "user", "content": SAY}])
    assert resp.parse().choices[0].message.content == "echo: reach me at <EMAIL_ADDRESS> after lunch"
    assert resp.headers["x-examlops-guardrails"] == "out-redact/pii/EMAIL_ADDRESS/redact=1"
    completion = red.completions.create(model="g-out-whole", prompt=SAY)
    assert EMAIL not in completion.choices[0].text and "<EMAIL_ADDRESS>" in completion.choices[0].text

    block = _key(stack, "g-out-whole", "out-block", *_pii_out("block"))
    err = blocked(lambda: block.chat.completions.create(model="g-out-whole",
                                                        messages=[{"role": "user", "content": SAY}]))
    assert EMAIL not in str(err) and "EMAIL_ADDRESS" in err["message"] and err["param"] is None
    assert _usage(stack, block)["completion_tokens"] == 7  # the tokens the engine produced are charged

    log = _key(stack, "g-out-whole", "out-log", *_pii_out("log"))
    resp = log.chat.completions.with_raw_response.create(model="g-out-whole",
                                                         messages=[{"role": "user", "content": SAY}])
    assert resp.parse().choices[0].message.content == f"echo: {SAY}"
    assert resp.headers["x-examlops-guardrails"] == "out-log/pii/EMAIL_ADDRESS/log=1"


@pytest.mark.parametrize("piece", [0, 3, 5, 7])
def test_an_email_split_across_stream_chunks_never_reaches_the_client(stack: Stack, piece: int) -> None:
    c = _endpoint(stack, "g-out-stream", "stream-redact", *_pii_out("redact"))
    filler = " ".join(f"w{i}" for i in range(100))  # longer than the pii window (254 characters)
    for shift in range(0, 64, 4):  # the email at every offset from where a scan falls
        say = f"{'x' * shift + ' ' if shift else ''}{filler} {SAY} {filler}"
        text, pieces, error = stream_text(c, "g-out-stream", say, **({"echo_piece_chars": piece} if piece else {}))
        assert not error
        assert text == f"echo: {say}".replace(EMAIL, "<EMAIL_ADDRESS>"), pieces
    assert all(EMAIL[i:i + 4] not in "".join(pieces) for i in range(len(EMAIL) - 4) if "@" in EMAIL[i:i + 4])
    if piece:
        assert len([p for p in pieces if p]) > 5  # released as it comes, not at the end only
        assert not any(EMAIL in p for p in _engine_pieces(say, piece))  # the engine split the email


def test_a_streamed_block_ends_with_an_error_event_and_charges_what_was_made(
        stack: Stack, redis_server: RedisServer) -> None:
    c = _endpoint(stack, "g-out-sblock", "stream-block", *_pii_out("block"))
    long_say = " ".join(f"w{i}" for i in range(100)) + " " + SAY  # longer than the window
    text, pieces, error = stream_text(c, "g-out-sblock", long_say, echo_piece_chars=6)
    assert error == "guardrail_blocked", (error, pieces)
    assert EMAIL[:5] not in text and "@" not in text, text
    assert text.startswith("echo: w0 w1 w2")  # what was clean and outside the window was released
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    (_, cost), = r.xrevrange("{vk:admin}:cost", count=1)
    assert cost["model"] == "g-out-sblock" and cost["status"] == "400", cost
    assert int(cost["completion_tokens"]) > len(text.split()), cost  # what the engine made, held text included
    assert cost["guarded"] == "stream-block/pii/EMAIL_ADDRESS/block=1", cost


def test_a_streamed_log_passes_the_text_and_records_it(stack: Stack) -> None:
    c = _endpoint(stack, "g-out-slog", "stream-log", *_pii_out("log"))
    text, _, error = stream_text(c, "g-out-slog", SAY, echo_piece_chars=4)
    assert not error and text == f"echo: {SAY}"
    metrics = httpx.get(stack.gateway_url + "/metrics").text
    assert 'action="log",detector="pii",direction="output",policy="stream-log"} 1.0' in metrics


def test_a_judge_route_that_is_down_blocks_unless_the_policy_allows(stack: Stack) -> None:
    register_echo(stack, "g-judged")
    stack.register("judge-down", engine="vllm-server", base_url=f"http://127.0.0.1:{free_port()}")
    closed = _key(stack, "g-judged", "judge-closed", "--detector", "model", "--route", "judge-down",
                  "--direction", "input", "--action", "block")
    err = blocked(lambda: closed.chat.completions.create(model="g-judged",
                                                         messages=[{"role": "user", "content": "hello"}]))
    assert "judge-down" in err["message"] and "JUDGE_UNAVAILABLE" in err["header"], err
    missing = _key(stack, "g-judged", "judge-missing", "--detector", "model", "--route", "no-such-route",
                   "--direction", "output", "--action", "block")
    _, _, error = stream_text(missing, "g-judged", "hello")
    assert error == "guardrail_blocked"
    allowed = _key(stack, "g-judged", "judge-open", "--detector", "model", "--route", "judge-down",
                   "--on-error", "allow", "--direction", "both", "--action", "block")
    resp = allowed.chat.completions.with_raw_response.create(model="g-judged",
                                                             messages=[{"role": "user", "content": "hello"}])
    assert resp.parse().choices[0].message.content == "echo: hello"
    assert "judge-open/model/JUDGE_UNAVAILABLE/allow=" in resp.headers["x-examlops-guardrails"]
