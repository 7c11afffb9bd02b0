"""Structured output through the gateway (issue 12, item 6), with the official openai client.

Real services and Redis. Engines: `echo` (answers with what it got: an engine that ignores any
schema) and the recording backend, which shows the body the engine got and answers what a test
scripts (`RecordingServer.answers`), so an answer can be invalid first and valid on the retry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import RedisServer, Stack, wait_until
from examlops_testsupport.recorder import RecordingServer

ECHO, REC = "so-echo", "so-rec"
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
HEADER = "x-examlops-structured"
VALID = '{"city": "Lyon", "population": 522000}'
WRONG = '{"city": "Lyon", "population": "many"}'


@dataclass
class World:
    stack: Stack
    engine: RecordingServer
    redis: redis.Redis

    def key(self) -> tuple[str, openai.OpenAI]:
        """A fresh virtual key with a budget on both models: (id, client)."""
        resp = httpx.post(self.stack.gateway_url + "/admin/keys", headers=ADMIN, timeout=10,
                          json={"tenant": "t", "project": "so", "models": [ECHO, REC], "budget_usd": 5})
        assert resp.status_code == 201, resp.text
        row = resp.json()
        return row["id"], openai.OpenAI(base_url=self.stack.gateway_url + "/v1", api_key=row["virtual_key"],
                                        max_retries=0)

    def records(self, key_id: str, count: int) -> list[dict[str, str]]:
        """The key's cost records, once `count` are there and nothing is reserved any more."""
        cost, key = "{vk:" + key_id + "}:cost", "{vk:" + key_id + "}:key"
        wait_until(lambda: self.redis.xlen(cost) >= count and int(self.redis.hget(key, "reserved") or 0) == 0,
                   5, what=f"{count} cost records")
        return [f for _id, f in self.redis.xrange(cost)]  # type: ignore[union-attr]

    def spent(self, key_id: str) -> int:
        return int(self.redis.hget("{vk:" + key_id + "}:key", "spent") or 0)


@pytest.fixture(scope="module")
def world(stack: Stack, redis_server: RedisServer) -> Iterator[World]:
    engine = RecordingServer()
    stack.register(ECHO, engine="echo")
    stack.register(REC, engine="vllm-server", base_url=engine.url)
    for model in (ECHO, REC):
        stack.registry().SetPrice(reg.SetPriceRequest(price=reg.Price(
            model=model, input_micro_usd_per_mtok=1_000_000, output_micro_usd_per_mtok=2_000_000), actor="tests"),
            timeout=5)
    wait_until(lambda: {ECHO, REC} <= {p["model"] for p in httpx.get(
        stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]}, 10, what="prices")
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    yield World(stack, engine, client)
    client.close()
    engine.close()


def ask(client: openai.OpenAI, model: str, response_format: dict[str, Any], text: str = "a city, as JSON",
        **extra: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, max_tokens=32, messages=[{"role": "user", "content": text}], response_format=response_format,
        **extra)  # type: ignore[arg-type]


def test_a_schema_that_is_not_json_schema_is_a_400_before_anything(world: World) -> None:
    key_id, client = world.key()
    calls = len(world.engine.bodies)
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "city": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, REC, broken)
    err = caught.value.body
    assert isinstance(err, dict)
    assert err["param"] == "response_format.json_schema.schema" and err["type"] == "invalid_request_error"
    assert "response_format" in err["message"] and "$.properties.city.type" in err["message"]
    assert len(world.engine.bodies) == calls  # the engine never saw it
    key = world.redis.hgetall("{vk:" + key_id + "}:key")
    assert key.get("requests", "0") == "0" and key.get("reserved", "0") == "0"  # nothing admitted
    with pytest.raises(openai.BadRequestError, match="nested deeper"):
        deep: dict[str, Any] = {"type": "object"}
        for _ in range(40):
            deep = {"type": "object", "properties": {"a": deep}}
        ask(client, REC, {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})
    with pytest.raises(openai.BadRequestError, match="not local"):
        ask(client, REC, {"type": "json_schema", "json_schema": {"name": "r", "schema": {
            "$ref": "http://example.com/city.json"}}})


def test_an_engine_ignoring_the_schema_is_retried_then_502_with_both_attempts_charged(world: World) -> None:
    key_id, client = world.key()
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client, ECHO, SCHEMA)
    exc = caught.value
    assert exc.status_code == 502 and exc.response.headers[HEADER] == "invalid"
    assert isinstance(exc.body, dict) and exc.body["code"] == "structured_output_invalid"
    assert exc.body["type"] == "invalid_response_error" and "2 attempts" in exc.body["message"]
    assert exc.body["message"].endswith("$: not valid JSON (at character 0): 'echo: a city, as JSON'")
    first, second = world.records(key_id, 2)
    for record in (first, second):
        assert record["status"] == "structured_invalid" and int(record["cost_micro_usd"]) > 0
    assert world.spent(key_id) == int(first["cost_micro_usd"]) + int(second["cost_micro_usd"])


def test_the_message_names_the_first_failing_json_path(world: World) -> None:
    _, client = world.key()
    world.engine.answers[:] = [WRONG, WRONG]
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client, REC, SCHEMA)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["message"].endswith("$.population: 'many' is not of type 'integer'")


def test_an_invalid_answer_then_a_valid_one_is_retried(world: World) -> None:
    key_id, client = world.key()
    calls = len(world.engine.bodies)
    world.engine.answers[:] = [WRONG, VALID]
    raw = ask(client, REC, SCHEMA)
    assert raw.headers[HEADER] == "retried"
    assert json.loads(raw.parse().choices[0].message.content) == json.loads(VALID)
    sent = world.engine.bodies[calls:]
    assert len(sent) == 2 and all(b["response_format"] == SCHEMA for b in sent)  # passed to guided decoding
    assert [r["status"] for r in world.records(key_id, 2)] == ["structured_invalid", "200"]


def test_a_valid_answer_is_valid_the_first_time(world: World) -> None:
    key_id, client = world.key()
    world.engine.answers[:] = [VALID]
    raw = ask(client, REC, SCHEMA)
    assert raw.headers[HEADER] == "valid" and raw.parse().choices[0].message.content == VALID
    assert [r["status"] for r in world.records(key_id, 1)] == ["200"]


def test_json_object_needs_an_object(world: World) -> None:
    _, client = world.key()
    world.engine.answers[:] = ['[1, 2]', '"text"']
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client, REC, {"type": "json_object"})
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["message"].endswith("'\"text\"' is not a JSON object")
    world.engine.answers[:] = ['{"any": ["thing"]}']
    assert ask(client, REC, {"type": "json_object"}).headers[HEADER] == "valid"
    assert ask(client, REC, {"type": "text"}).headers.get(HEADER) is None  # no contract, no verdict


def test_an_invalid_stream_ends_with_an_error_event_instead_of_its_last_chunk(world: World) -> None:
    key_id, client = world.key()
    raw = client.chat.completions.with_raw_response.create(
        model=ECHO, max_tokens=32, stream=True, response_format=SCHEMA,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "name the path"}])
    assert raw.headers[HEADER] == "deferred"  # sent before the answer: the verdict is the last event
    got: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in raw.parse():
            got.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(got) == "echo: name the"  # passed through as made; the last chunk was held, then dropped
    assert caught.value.code == "structured_output_invalid" and "a stream is not retried" in caught.value.message
    (record,) = world.records(key_id, 1)
    assert record["status"] == "structured_invalid" and record["completion_tokens"] == "4"  # all it made


def test_a_valid_stream_releases_its_last_chunk(world: World) -> None:
    _, client = world.key()
    world.engine.answers[:] = [VALID]
    stream = client.chat.completions.create(
        model=REC, max_tokens=32, stream=True, response_format=SCHEMA,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "a city"}])
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == VALID
    assert chunks[-1].usage is not None and not chunks[-1].choices  # the usage chunk stays last
