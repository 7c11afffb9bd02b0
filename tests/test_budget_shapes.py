"""Budgets hold for every request shape (issue 17): the output bound the engine obeys, lists of
prompts, every text part type, and only known fields reaching the engine.

Real services and Redis; the engine is the recording backend in `to_the_limit` mode, which shows
the body vLLM would get and reports the usage of a vLLM 0.32 whose model never stops early.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until
from examlops_testsupport.recorder import RecordingServer

MODEL = "shapes"
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
OVERHEAD = 64  # EXAMLOPS_PROMPT_OVERHEAD_TOKENS


@dataclass
class Shapes:
    stack: Stack
    engine: RecordingServer
    redis: redis.Redis

    def key(self, **limits: Any) -> tuple[str, str]:
        """A virtual key on MODEL: (id, secret)."""
        resp = httpx.post(self.stack.gateway_url + "/admin/keys", headers=ADMIN,
                          json={"tenant": "t", "project": "shapes", "models": [MODEL], **limits})
        assert resp.status_code == 201, resp.text
        row = resp.json()
        return row["id"], row["virtual_key"]

    def call(self, key: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
        raw = json.dumps(body).encode()  # the standard library writes any integer, as a client may
        return httpx.post(self.stack.gateway_url + path, content=raw, timeout=30,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})

    def spent(self, key_id: str) -> int:
        """The key's settled spend in micro-USD, once nothing is reserved any more."""
        record = "{vk:" + key_id + "}:key"
        wait_until(lambda: int(self.redis.hget(record, "reserved") or 0) == 0, 5)
        return int(self.redis.hget(record, "spent") or 0)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Shapes]:
    engine = RecordingServer(to_the_limit=True)
    fast = {"EXAMLOPS_PRICE_REFRESH_S": "0.2"}
    with running_stack(tmp_path_factory.mktemp("shapes"), redis_server, fast) as stack:
        stack.register(MODEL, engine="vllm-server", base_url=engine.url)
        # 1 micro-USD per prompt token, 2 per completion token
        stack.registry().SetPrice(reg.SetPriceRequest(price=reg.Price(
            model=MODEL, input_micro_usd_per_mtok=1_000_000, output_micro_usd_per_mtok=2_000_000), actor="tests"),
            timeout=5)
        wait_until(lambda: any(p["model"] == MODEL for p in httpx.get(
            stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]), 10)
        client = redis.Redis(port=redis_server.port, decode_responses=True)
        yield Shapes(stack, engine, client)
        client.close()
    engine.close()


def affordable(budget_micro: int, body: dict[str, Any], choices: int = 1) -> int:
    """The output bound a fresh budget pays for: (budget - prompt bound x 1) / (choices x 2)."""
    return (budget_micro - (len(json.dumps(body).encode()) + OVERHEAD)) // (2 * choices)


# --- 1. the output bound the engine obeys ------------------------------------------------------

def test_completions_reserve_and_send_max_tokens_not_max_completion_tokens(shapes: Shapes) -> None:
    """The exploit: max_completion_tokens 1 was reserved, and vLLM's completions ran max_tokens 2000."""
    key_id, key = shapes.key(budget_usd=0.001)  # 1,000 micro-USD
    body = {"model": MODEL, "prompt": "hi", "max_completion_tokens": 1, "max_tokens": 2000}
    seen = len(shapes.engine.bodies)
    refused = shapes.call(key, body)  # a field vLLM's completions ignore is not forwarded (item 5)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_completion_tokens"
    assert len(shapes.engine.bodies) == seen
    del body["max_completion_tokens"]
    resp = shapes.call(key, body)
    assert resp.status_code == 200, resp.text
    sent = shapes.engine.bodies[-1]
    assert sent["max_tokens"] == affordable(1000, body) < 2000  # the reserved bound, in the field vLLM reads
    assert shapes.spent(key_id) == 1 + 2 * sent["max_tokens"] <= 1000


def test_completions_without_max_tokens_get_vllm_default_sent(shapes: Shapes) -> None:
    key_id, key = shapes.key(budget_usd=1)
    assert shapes.call(key, {"model": MODEL, "prompt": "hi"}).status_code == 200
    assert shapes.engine.bodies[-1]["max_tokens"] == 16  # reserved and sent, not left to the engine
    assert shapes.spent(key_id) == 1 + 2 * 16


def test_chat_reserves_max_completion_tokens_which_vllm_prefers(shapes: Shapes) -> None:
    key_id, key = shapes.key(budget_usd=0.001)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3, "max_tokens": 2000}
    assert shapes.call(key, body, "/v1/chat/completions").status_code == 200
    sent = shapes.engine.bodies[-1]
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (3, 2000)  # vLLM runs 3
    assert shapes.spent(key_id) == 1 + 2 * 3
    body["max_completion_tokens"] = 5000  # more than the budget pays for: both fields carry the bound
    assert shapes.call(key, body, "/v1/chat/completions").status_code == 200
    sent = shapes.engine.bodies[-1]
    assert sent["max_completion_tokens"] == sent["max_tokens"] < 5000
    assert shapes.spent(key_id) <= 1000


@pytest.mark.parametrize("value", [1.5, 2.0, "5", True, 2**31, 10**30])
@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "max_tokens"),
                                              ("/v1/chat/completions", "max_tokens"),
                                              ("/v1/chat/completions", "max_completion_tokens")])
def test_non_integer_output_bounds_are_400_naming_the_field(shapes: Shapes, path: str, field: str,
                                                           value: Any) -> None:
    body: dict[str, Any] = {"model": MODEL, field: value}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    seen = len(shapes.engine.bodies)
    for key in (shapes.key(budget_usd=1)[1], DEFAULT_ADMIN_KEY):
        resp = shapes.call(key, body, path)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == field
    assert len(shapes.engine.bodies) == seen


# --- 2. every prompt and every choice -------------------------------------------------------------

def test_a_list_of_prompts_is_reserved_for_every_prompt_and_choice(shapes: Shapes) -> None:
    """The exploit: 200 prompts were reserved as one; the engine ran 200 x max_tokens."""
    key_id, key = shapes.key(budget_usd=0.01)  # 10,000 micro-USD
    body = {"model": MODEL, "prompt": ["a"] * 200, "max_tokens": 50}
    assert shapes.call(key, body).status_code == 200
    sent = shapes.engine.bodies[-1]["max_tokens"]
    assert sent == affordable(10_000, body, choices=200) < 50
    assert shapes.spent(key_id) == 200 + 2 * 200 * sent <= 10_000
    key_id, key = shapes.key(budget_usd=0.01)
    ids = {"model": MODEL, "prompt": [[7, 8]] * 100, "n": 2, "max_tokens": 50}  # token-id prompts, n each
    assert shapes.call(key, ids).status_code == 200
    sent = shapes.engine.bodies[-1]["max_tokens"]
    assert sent == affordable(10_000, ids, choices=200) < 50
    assert shapes.spent(key_id) == 200 + 2 * 200 * sent <= 10_000


def test_a_tpm_key_is_charged_for_every_prompt(shapes: Shapes) -> None:
    key_id, key = shapes.key(tpm=2000)
    body = {"model": MODEL, "prompt": ["a"] * 200, "max_tokens": 50}
    assert shapes.call(key, body).status_code == 200
    bound = len(json.dumps(body).encode()) + OVERHEAD
    sent = shapes.engine.bodies[-1]["max_tokens"]
    assert sent == (2000 - bound) // 200  # the bucket holds all 200
    shapes.spent(key_id)  # settled: the key is charged the tokens of every prompt
    assert shapes.redis.hmget("{vk:" + key_id + "}:key", "prompt_tokens", "completion_tokens") == [
        "200", str(200 * sent)]
    seen = len(shapes.engine.bodies)
    too_many = shapes.call(shapes.key(tpm=2000)[1], {"model": MODEL, "prompt": ["a"] * 1000})
    assert too_many.status_code == 429 and too_many.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(shapes.engine.bodies) == seen


@pytest.mark.parametrize("prompt", [["a"] * 1025, [[1]] * 1025, []])
def test_prompt_count_is_bounded_for_every_key(shapes: Shapes, prompt: list[Any]) -> None:
    seen = len(shapes.engine.bodies)
    for key in (shapes.key()[1], DEFAULT_ADMIN_KEY):
        resp = shapes.call(key, {"model": MODEL, "prompt": prompt})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt" and "EXAMLOPS_MAX_PROMPTS" in resp.json()["error"]["message"]
    assert len(shapes.engine.bodies) == seen


# --- 3. every part vLLM renders as text counts as text ------------------------------------------

TEXT_PARTS = [{"type": "input_text", "text": ""}, {"type": "output_text", "text": ""},
              {"type": "refusal", "refusal": ""}, {"type": "thinking", "thinking": ""}]


@pytest.mark.parametrize("part", TEXT_PARTS, ids=lambda p: p["type"])
def test_text_parts_of_every_type_are_bounded_by_their_bytes(shapes: Shapes, part: dict[str, str]) -> None:
    """The exploit: a 50,000-word input_text part was bounded as one media part (4,096 tokens)."""
    field = next(k for k in part if k != "type")
    big = {**part, field: "w " * 50_000}
    body = {"model": MODEL, "max_tokens": 10,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "read"}, big]}]}
    seen = len(shapes.engine.bodies)
    _, small = shapes.key(budget_usd=0.02)  # 20,000 micro-USD: less than the part's 100,000 bytes
    denied = shapes.call(small, body, "/v1/chat/completions")
    assert denied.status_code == 429 and denied.json()["error"]["code"] == "budget_exceeded", denied.text
    assert len(shapes.engine.bodies) == seen
    key_id, key = shapes.key(budget_usd=1)
    assert shapes.call(key, body, "/v1/chat/completions").status_code == 200
    assert shapes.spent(key_id) == 50_001 + 2 * 10  # the engine rendered every word as prompt text


def test_unknown_part_types_are_400_naming_the_part(shapes: Shapes) -> None:
    parts = [{"type": "text", "text": "hi"}, {"type": "input_text", "text": "fine"}, {"type": "input_foo", "text": "x"}]
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]}
    seen = len(shapes.engine.bodies)
    for key in (shapes.key(budget_usd=1)[1], DEFAULT_ADMIN_KEY):
        resp = shapes.call(key, body, "/v1/chat/completions")
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == ("messages[1].content[2]", "media_type_not_allowed")
        assert "input_foo" in err["message"]
    assert len(shapes.engine.bodies) == seen


# --- 5. only fields the gateway knows reach the engine -------------------------------------------

ENGINE_STEERING = {"kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 7777, "do_remote_prefill": True},
                   "priority": -100, "request_id": "victim-request", "vllm_xargs": {"k": "v"},
                   "media_io_kwargs": {"video": {"num_frames": 100000}}, "mm_processor_kwargs": {"fps": 1000}}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", [*ENGINE_STEERING, "best_of", "chat_template"])
def test_unknown_fields_are_400_naming_them_and_never_reach_the_engine(shapes: Shapes, path: str,
                                                                       field: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, field: ENGINE_STEERING.get(field, 2)}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    seen = len(shapes.engine.bodies)
    resp = shapes.call(shapes.key(budget_usd=1)[1], body, path)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unsupported_field", field)
    assert len(shapes.engine.bodies) == seen


def test_documented_sampling_fields_still_reach_the_engine(shapes: Shapes) -> None:
    _, key = shapes.key(budget_usd=1)
    sampling = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop": ["\n"], "seed": 7, "logprobs": 2}
    assert shapes.call(key, {"model": MODEL, "prompt": "x", "max_tokens": 5, **sampling}).status_code == 200
    assert sampling.items() <= shapes.engine.bodies[-1].items()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "top_k": 3,
            "chat_template_kwargs": {"enable_thinking": False}, "tools": [], "parallel_tool_calls": False}
    assert shapes.call(key, chat, "/v1/chat/completions").status_code == 200
    assert chat.items() <= shapes.engine.bodies[-1].items()  # forwarded as sent: max_tokens was affordable
    admin = shapes.call(DEFAULT_ADMIN_KEY, {"model": MODEL, "prompt": "x", "priority": 0})
    assert admin.status_code == 200 and shapes.engine.bodies[-1]["priority"] == 0  # the operator's key passes all
