"""The gateway, driven by the official openai client against real services and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    stack.register("echo-a", engine="echo")
    wait_until(lambda: _routable(stack, "echo-a"))
    c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    yield c
    c.close()


def _routable(stack: Stack, name: str) -> bool:
    resp = httpx.get(stack.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"})
    return any(m["id"] == name for m in resp.json()["data"])


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="echo-a", messages=[{"role": "user", "content": "hello big world"}])
    assert resp.choices[0].message.content == "echo: hello big world"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 4


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="echo-a", messages=[{"role": "user", "content": "one two three"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: one two three"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_streaming_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="echo-a", messages=[{"role": "user", "content": "a b"}], stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_max_tokens_truncates_with_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="echo-a", max_tokens=2,
                                          messages=[{"role": "user", "content": "a b c d"}])
    assert resp.choices[0].message.content == "echo: a"
    assert resp.choices[0].finish_reason == "length"


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="echo-a", prompt="say this")
    assert resp.choices[0].text == "echo: say this"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="echo-a", prompt="say this", stream=True) if c.choices)
    assert streamed == "echo: say this"


def test_async_client_streaming_and_not(stack: Stack, client: openai.OpenAI) -> None:
    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        msgs = [{"role": "user", "content": "async works"}]
        plain = await aclient.chat.completions.create(model="echo-a", messages=msgs)  # type: ignore[arg-type]
        stream = await aclient.chat.completions.create(model="echo-a", messages=msgs, stream=True)  # type: ignore[arg-type]
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        many = await asyncio.gather(*[aclient.chat.completions.create(
            model="echo-a", messages=[{"role": "user", "content": f"n {i}"}]) for i in range(20)])
        assert [m.choices[0].message.content for m in many] == [f"echo: n {i}" for i in range(20)]
        await aclient.close()
        return plain.choices[0].message.content or "", "".join(parts)

    plain, streamed = asyncio.run(run())
    assert plain == streamed == "echo: async works"


def test_models_lists_routable_only(stack: Stack, client: openai.OpenAI) -> None:
    stack.register("stopped-b", engine="echo", state=reg.ENDPOINT_STATE_STOPPED)
    stack.register("noaddr-c", engine="vllm-server", state=reg.ENDPOINT_STATE_PENDING)
    stack.register("marker-g", engine="echo")
    wait_until(lambda: _routable(stack, "marker-g"))  # registered after the others: they are known too
    ids = {m.id for m in client.models.list()}
    assert "echo-a" in ids
    assert "stopped-b" not in ids and "noaddr-c" not in ids


def test_stopped_endpoint_is_not_routed(stack: Stack, client: openai.OpenAI) -> None:
    stack.register("stopped-d", engine="echo", state=reg.ENDPOINT_STATE_STOPPED)
    def refused() -> bool:
        try:
            client.chat.completions.create(model="stopped-d", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as exc:
            body = exc.body
            assert isinstance(body, dict)
            return body["code"] == "model_not_found" and "STOPPED" in body["message"]
        return False
    wait_until(refused)


def test_endpoint_without_address_is_not_routed(stack: Stack, client: openai.OpenAI) -> None:
    stack.register("pending-e", engine="vllm-server", state=reg.ENDPOINT_STATE_PENDING)

    def refused() -> bool:
        try:
            client.chat.completions.create(model="pending-e", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as exc:
            return "no address" in str(exc)
        return False
    wait_until(refused)


def test_dead_server_gives_all_backends_failed(stack: Stack, client: openai.OpenAI) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    stack.register("dead-f", engine="vllm-server", base_url=dead)
    wait_until(lambda: _routable(stack, "dead-f"))
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="dead-f", messages=[{"role": "user", "content": "x"}], stream=stream)
        assert info.value.status_code == 502
        body = info.value.body
        assert isinstance(body, dict)
        assert body["type"] == "AllBackendsFailed"
        assert "endpoint:dead-f" in body["message"]


def _raw(stack: Stack, body: bytes | str, key: str = DEFAULT_ADMIN_KEY,
         path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(stack.gateway_url + path, content=body, headers=headers)


ONE_MSG = '{"model": "echo-a", "messages": [{"role": "user", "content": "x"}]}'


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ("{not json", 400, "invalid_json", None),
    ('{"model": "echo-a"}', 400, "missing_required_parameter", "messages"),
    ('{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_required_parameter", "model"),
    ('{"model": "echo-a", "messages": []}', 400, "invalid_value", "messages"),
    ('{"model": "echo-a", "messages": [{"role": "wizard", "content": "x"}]}', 400, "invalid_value", "messages.0.role"),
    (ONE_MSG[:-1] + ', "max_tokens": 0}', 400, "invalid_value", "max_tokens"),
    (ONE_MSG[:-1] + ', "stream": "yes"}', 400, "invalid_value", "stream"),
    ('[1, 2]', 400, "invalid_value", None),
    ('{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found", "model"),
])
def test_bad_bodies_get_openai_shaped_errors(client: openai.OpenAI, stack: Stack, body: str, status: int,
                                             code: str, param: str | None) -> None:
    resp = _raw(stack, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["code"] == code and err["param"] == param and err["message"]


def test_auth_errors(client: openai.OpenAI, stack: Stack) -> None:
    ok = '{"model": "echo-a", "messages": [{"role": "user", "content": "x"}]}'
    for key in ("", "wrong-key"):
        resp = _raw(stack, ok, key=key)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="nope", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_oversized_body_is_413(stack: Stack, client: openai.OpenAI) -> None:
    big = '{"model": "echo-a", "messages": [{"role": "user", "content": "' + "x" * (17 * 1024 * 1024) + '"}]}'
    resp = _raw(stack, big)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_unknown_path_and_method_are_openai_shaped(stack: Stack) -> None:
    resp = httpx.get(stack.gateway_url + "/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    resp = httpx.get(stack.gateway_url + "/v1/chat/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_healthz_and_metrics(stack: Stack, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="echo-a", messages=[{"role": "user", "content": "count me"}])
    assert httpx.get(stack.gateway_url + "/healthz").json()["status"] == "ok"
    metrics = httpx.get(stack.gateway_url + "/metrics").text
    assert 'examlops_gateway_requests_total{model="echo-a",status="200"}' in metrics


def test_openapi_describes_the_openai_routes_and_their_error_shape(stack: Stack) -> None:
    doc = httpx.get(stack.gateway_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    detail = schemas[schemas["ErrorResponse"]["properties"]["error"]["$ref"].rsplit("/", 1)[-1]]
    assert set(detail["properties"]) == {"message", "type", "code", "param"}
    expected = {("post", "/v1/chat/completions"): {400, 401, 403, 404, 413, 429, 502, 503},
                ("post", "/v1/completions"): {400, 401, 403, 404, 413, 429, 502, 503},
                ("get", "/v1/models"): {401, 503}}
    for (method, path), statuses in expected.items():
        op = doc["paths"][path][method]
        errors = {int(s) for s in op["responses"] if int(s) >= 400}
        assert errors == statuses, (path, errors)
        for status in statuses:
            schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in schemas[body["$ref"].rsplit("/", 1)[-1]]["properties"]
