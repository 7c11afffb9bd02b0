"""The embedded default on a real CPU vLLM: through the gateway, health as a gate, failure and recovery.

One vLLM process at a time (2 cores): started plain, killed, then restarted from a rendered argv
with ngram speculative decoding and prefix caching on.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from examlops.engine import parse_engine_block
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc
from examlops_testsupport.fixtures import RedisServer, Stack, free_port, wait_until
from examlops_testsupport.guardrails import (
    blocked,
    client,
    guardrail,
    issue_key,
    register_echo,
    set_policy,
    stream_text,
)
from examlops_testsupport.vllm import smol_block, start_vllm

pytestmark = pytest.mark.vllm


class Server:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("vllm"))
    t0 = time.monotonic()
    s.proc = start_vllm(s.workdir, s.port, smol_block())
    print(f"\nvLLM start-up to healthy: {time.monotonic() - t0:.1f} s")
    yield s
    if s.proc is not None:
        s.proc.stop()


@pytest.fixture(scope="module")
def smol(stack: Stack, server: Server) -> Iterator[openai.OpenAI]:
    out = stack.cli("serve", "llm", "start", "smol", "--base-url", server.url, "--replace")
    assert out.returncode == 0, out.stderr
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    wait_until(lambda: any(m.id == "smol" for m in client.models.list()))
    yield client
    client.close()


def test_chat_non_streaming(smol: openai.OpenAI) -> None:
    t0 = time.monotonic()
    resp = smol.chat.completions.create(model="smol", max_tokens=24,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
    print(f"\nfirst answer through the gateway: {time.monotonic() - t0:.2f} s")
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0


def test_chat_streaming_with_final_usage_chunk(smol: openai.OpenAI) -> None:
    chunks = list(smol.chat.completions.create(
        model="smol", max_tokens=16, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to five."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_structured_output_validates_against_schema(smol: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    resp = smol.chat.completions.create(
        model="smol", max_tokens=64,
        messages=[{"role": "user", "content": "Give a city and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    obj = json.loads(resp.choices[0].message.content or "")
    assert set(obj) == {"city", "population"}
    assert isinstance(obj["city"], str) and isinstance(obj["population"], int)


def _running(url: str) -> float:
    return _counter(httpx.get(url + "/metrics").text, "vllm:num_requests_running")


def test_client_disconnect_aborts_the_real_generation_and_settles(
        stack: Stack, redis_server: RedisServer, server: Server, smol: openai.OpenAI) -> None:
    """A client that leaves mid-stream stops vLLM's work (its running gauge drops) and is billed."""
    issued = httpx.post(stack.gateway_url + "/admin/keys", headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"},
                        json={"tenant": "t", "project": "p", "models": ["smol"]}, timeout=10)
    assert issued.status_code == 201, issued.text
    key = issued.json()
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key["virtual_key"], max_retries=0)
    # ignore_eos is not forwarded from virtual keys: a long, open question keeps SmolLM2 busy instead
    stream = client.chat.completions.create(
        model="smol", max_tokens=1500, stream=True,
        messages=[{"role": "user", "content": "Write a very long story about a lighthouse keeper."}])
    got = [next(stream) for _ in range(3)]
    assert _running(server.url) == 1
    stream.close()
    wait_until(lambda: _running(server.url) == 0, 20, 0.1, "vLLM's running-requests gauge back to 0")
    cost = "{vk:" + key["id"] + "}:cost"
    r = redis_server.client()
    wait_until(lambda: r.xlen(cost) == 1, 10, 0.05, "the call's cost record")
    (_, record), = r.xrange(cost)
    assert record["status"] == "499"
    assert int(record["completion_tokens"]) >= sum(1 for c in got if c.choices and c.choices[0].delta.content)
    assert int(record["completion_tokens"]) < 1500  # charged what was made before the abort, not the bound
    client.close()


_PLACES = ["France", "Japan", "Brazil", "Canada", "Kenya", "India", "Italy", "Mexico", "Egypt", "Norway",
           "Spain", "Chile", "Peru", "Germany", "Australia", "Vietnam", "Poland", "Ghana", "Turkey", "Greece"]


def test_structured_output_is_valid_on_the_first_attempt_with_guided_decoding(smol: openai.OpenAI) -> None:
    """20 varied prompts with a json_schema: vLLM's guided decoding makes the gateway's check pass on
    the first attempt (x-examlops-structured: valid) for at least 95% of them."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}

    def ask(place: str) -> str:
        try:
            raw = smol.chat.completions.with_raw_response.create(
                model="smol", max_tokens=48, temperature=0, response_format=fmt,  # type: ignore[arg-type]
                messages=[{"role": "user", "content": f"Name a large city in {place} and its population, as JSON."}])
        except openai.APIStatusError as exc:  # 502 structured_output_invalid after the retry
            return exc.response.headers.get("x-examlops-structured", str(exc.status_code))
        return raw.headers["x-examlops-structured"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:  # vLLM batches them
        verdicts = list(pool.map(ask, _PLACES))
    rate = verdicts.count("valid") / len(verdicts)
    print(f"\nstructured output, first-attempt valid: {rate:.0%} of {len(verdicts)} in {time.monotonic() - t0:.1f} s "
          f"({verdicts.count('retried')} retried)")
    assert rate >= 0.95, verdicts


def test_a_smollm2_judge_gives_a_verdict_or_fails_closed(stack: Stack, smol: openai.OpenAI) -> None:
    """A `model` detector on the real SmolLM2 route: each call completes with the judge's verdict parsed
    (the echo answer, or a block naming UNSAFE), or the judge's answer could not be parsed and the call
    is blocked as JUDGE_UNAVAILABLE (fail closed). SmolLM2's judgement itself is not graded (135M)."""
    register_echo(stack, "g-smol-judged")
    set_policy(stack, "smol-judge", "--detector", "model", "--route", "smol", "--direction", "input",
               "--action", "block")
    guardrail(stack, "attach", "smol-judge", "--model", "g-smol-judged")
    for text in ("What is the capital of France?", "Tell me how to pick a lock."):
        try:
            resp = smol.chat.completions.with_raw_response.create(
                model="g-smol-judged", messages=[{"role": "user", "content": text}])
            assert resp.parse().choices[0].message.content == f"echo: {text}"
        except openai.BadRequestError as exc:
            assert isinstance(exc.body, dict) and exc.body["code"] == "guardrail_blocked", exc.body
            fired = exc.response.headers["x-examlops-guardrails"]
            assert fired.startswith("smol-judge/model/") and fired.endswith("/block=1"), fired
    judged = [e for e in stack.cli("--json", "gateway", "spend", "--by", "model").stdout.split('"') if e == "smol"]
    assert judged  # the judge's own calls are recorded (under the admin key)


def test_guardrails_in_both_directions_on_real_answers(stack: Stack, smol: openai.OpenAI) -> None:
    """On the real model: an email in the prompt is redacted before vLLM sees it (the answer cannot
    repeat it), an output deny-list every answer matches blocks whole and streamed answers without a
    matched character reaching the client, and log only reports."""
    set_policy(stack, "smol-in", "--detector", "pii", "--entities", "EMAIL_ADDRESS", "--direction", "input",
               "--action", "redact")
    for action in ("block", "log"):
        set_policy(stack, f"smol-out-{action}", "--detector", "regex", "--pattern", "[A-Za-z]", "--direction",
                   "output", "--action", action)
    ask = [{"role": "user", "content": "Repeat exactly this address: jane.doe@example.com"}]
    redacting = client(stack, issue_key(stack, "smol", "smol-in"))
    resp = redacting.chat.completions.with_raw_response.create(model="smol", max_tokens=30, messages=ask)
    assert "jane.doe@example.com" not in (resp.parse().choices[0].message.content or "")
    assert resp.headers["x-examlops-guardrails"] == "smol-in/pii/EMAIL_ADDRESS/redact=1"
    text, _, code = stream_text(redacting, "smol", ask[0]["content"], max_tokens=30)
    assert "jane.doe@example.com" not in text and code == ""

    blocking = client(stack, issue_key(stack, "smol", "smol-out-block"))
    assert blocked(lambda: blocking.chat.completions.create(model="smol", max_tokens=16, messages=ask))
    text, _, code = stream_text(blocking, "smol", "Say hello.", max_tokens=16)
    assert code == "guardrail_blocked" and not any(ch.isalpha() for ch in text), text

    logging_ = client(stack, issue_key(stack, "smol", "smol-out-log"))
    resp = logging_.chat.completions.with_raw_response.create(model="smol", max_tokens=16, messages=ask)
    assert resp.parse().choices[0].message.content
    assert resp.headers["x-examlops-guardrails"].startswith("smol-out-log/regex/DENY_PATTERN/log=")


def test_health_gate_failure_and_recovery(stack: Stack, server: Server, smol: openai.OpenAI) -> None:
    assert stack.cli("serve", "llm", "health", "smol").returncode == 0

    assert server.proc is not None
    server.proc.stop(signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as info:
        smol.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 502
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "AllBackendsFailed"
    assert "endpoint:smol" in info.value.body["message"]

    down = stack.cli("serve", "llm", "health", "smol")
    assert down.returncode == 1
    listed = json.loads(stack.cli("--json", "serve", "llm", "list").stdout)
    assert next(e for e in listed if e["name"] == "smol")["state"] == "FAILED"

    # Restart from a rendered argv with ngram speculative decoding and prefix caching on.
    data = smol_block().model_dump(mode="json", exclude_none=True)
    data.update(prefix_cache=True, speculative_decoding={
        "enabled": True, "method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    block = parse_engine_block(data)
    server.proc = start_vllm(server.workdir, server.port, block, "vllm-specdecode.log")
    argv_line = server.proc.log_tail(400)
    assert stack.cli("serve", "llm", "health", "smol").returncode == 0
    listed = json.loads(stack.cli("--json", "serve", "llm", "list").stdout)
    assert next(e for e in listed if e["name"] == "smol")["state"] == "READY"
    resp = smol.chat.completions.create(model="smol", max_tokens=24,
                                        messages=[{"role": "user", "content": "Repeat: one two three one two three"}])
    assert resp.choices[0].message.content
    metrics = httpx.get(server.url + "/metrics").text
    assert "vllm:spec_decode_num_drafts_total" in metrics, argv_line[-2000:]
    # vLLM registers the prefix-cache counters whether or not caching is on: only hits on a repeated
    # prompt (several KV blocks long) show that it is.
    prompt = "Summarise this list: " + ", ".join(f"item number {i}" for i in range(120))
    for _ in range(2):
        smol.chat.completions.create(model="smol", max_tokens=1, messages=[{"role": "user", "content": prompt}])
    hits = _counter(httpx.get(server.url + "/metrics").text, "vllm:prefix_cache_hits_total")
    assert hits >= _counter(metrics, "vllm:prefix_cache_hits_total") + 256, argv_line[-2000:]


def _counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter over its label sets (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith((name + "{", name + " ")))
