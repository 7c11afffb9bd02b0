"""engine-proxy's stream messages from a vllm-server engine: the events of one network read go in one
message, none is held back for more, a split event is put together; GenerateOnce answers whole
calls with Generate's routing, usage and errors. A scripted server writes the answer as the test
says, waiting for the test's signal between writes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.scripted import (
    DONE,
    EVENTS,
    MODEL,
    PROMPT,
    USAGE_CHUNK,
    WHOLE,
    WORDS,
    ScriptedServer,
    stripped,
)


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> Iterator[tuple[ScriptedServer, pb_grpc.EngineProxyStub]]:
    server = ScriptedServer()
    server.scripts["ping"] = [b"".join(EVENTS) + DONE]
    stack.register(MODEL, engine="vllm-server", base_url=server.url,
                   engine_block_json=json.dumps({"engine": "vllm", "hf_model_id": "org/m"}))
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    wait_until(lambda: _routed(stub), 10, what="engine-proxy routes the scripted server")
    try:
        yield server, stub
    finally:
        server.close()


def _routed(stub: pb_grpc.EngineProxyStub) -> bool:
    try:
        list(stub.Generate(request("ping"), timeout=10))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
            return False
        raise
    return True


def request(script: str, stream: bool = True, **options: bool) -> pb.GenerateRequest:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": script}], "stream": stream}
    if options:
        body["stream_options"] = options
    return pb.GenerateRequest(endpoint=MODEL, kind=pb.REQUEST_KIND_CHAT, body_json=json.dumps(body).encode())


def test_one_read_of_eight_events_is_one_message(scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, stub = scripted
    server.scripts["burst"] = [b"".join(EVENTS) + USAGE_CHUNK + DONE]
    messages = list(stub.Generate(request("burst", include_usage=True, continuous_usage_stats=True), timeout=30))
    assert len(messages) == 1
    (only,) = messages
    assert only.final and not only.data and only.replica == "r0"
    assert only.sse == b"".join(EVENTS) + USAGE_CHUNK  # byte for byte, [DONE] left for the gateway
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (PROMPT, 7)


def test_each_write_is_one_message_and_none_waits_for_the_next(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, stub = scripted
    go = [threading.Event() for _ in range(3)]
    server.scripts["paced"] = [EVENTS[0], go[0], b"".join(EVENTS[1:4]), go[1], b"".join(EVENTS[4:8]), go[2], DONE]
    answer = stub.Generate(request("paced"), timeout=30)
    for n, (expected, delivered) in enumerate([(EVENTS[0:1], 0), (EVENTS[1:4], 3), (EVENTS[4:8], 7)]):
        message = next(answer)  # arrives while the server waits for go[n]: nothing was held back
        assert message.sse == b"".join(stripped(e) for e in expected)
        assert message.usage.completion_tokens == delivered
        go[n].set()
    rest = list(answer)
    assert [m.final for m in rest] == [True] and not rest[0].sse
    assert rest[0].usage.completion_tokens == 7  # the last chunk's running usage


def test_an_event_split_across_two_reads_is_put_together(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, stub = scripted
    go = threading.Event()
    cut = len(EVENTS[1]) // 2
    server.scripts["split"] = [EVENTS[0] + EVENTS[1][:cut], go, EVENTS[1][cut:] + b"".join(EVENTS[2:]) + DONE]
    answer = stub.Generate(request("split", include_usage=True, continuous_usage_stats=True), timeout=30)
    first = next(answer)
    assert first.sse == EVENTS[0]  # the half event waits for its other half
    go.set()
    rest = list(answer)
    assert b"".join(m.sse for m in rest) == b"".join(EVENTS[1:])
    assert rest[-1].final and rest[-1].usage.completion_tokens == 7


def test_the_usage_chunk_goes_only_to_a_client_that_asked(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, stub = scripted
    server.scripts["usage"] = [b"".join(EVENTS) + USAGE_CHUNK + DONE]
    for options, tail in (({}, b""), ({"include_usage": True}, USAGE_CHUNK)):
        messages = list(stub.Generate(request("usage", **options), timeout=30))
        assert b"".join(m.sse for m in messages) == b"".join(stripped(e) for e in EVENTS) + tail
        assert messages[-1].usage.completion_tokens == 7


def test_an_error_event_mid_read_sends_the_events_before_it_then_fails(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, stub = scripted
    error = b'data: {"error":{"message":"the engine died","type":"InternalServerError","code":500}}\n\n'
    server.scripts["error"] = [b"".join(EVENTS[:3]) + error + b"".join(EVENTS[3:]) + DONE]
    got: list[pb.GenerateChunk] = []
    with pytest.raises(grpc.RpcError) as info:
        for message in stub.Generate(request("error", include_usage=True, continuous_usage_stats=True), timeout=30):
            got.append(message)
    assert b"".join(m.sse for m in got) == b"".join(EVENTS[:3])
    assert got[-1].usage.completion_tokens == 2  # what a cut stream is billed
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "the engine died" in info.value.details()  # type: ignore[attr-defined]


def test_generate_once_answers_whole_with_generate_s_fields(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    _, stub = scripted
    once = stub.GenerateOnce(request("whole", stream=False), timeout=30)
    (streamed,) = list(stub.Generate(request("whole", stream=False), timeout=30))
    assert once.data == streamed.data == WHOLE
    assert once.final and once.replica == "r0" and not once.sse
    assert (once.usage.prompt_tokens, once.usage.completion_tokens) == (PROMPT, 2)
    assert once == streamed


@pytest.mark.parametrize(("script", "stream", "code", "reason", "param"), [
    ("refuse", False, grpc.StatusCode.INVALID_ARGUMENT, "engine_rejected", ""),
    ("whole", True, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "stream"),
])
def test_generate_once_errors_keep_their_codes_and_metadata(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub], script: str, stream: bool,
        code: grpc.StatusCode, reason: str, param: str) -> None:
    _, stub = scripted
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(request(script, stream=stream), timeout=30)
    assert info.value.code() == code  # type: ignore[attr-defined]
    assert error_reason(info.value) == (reason, param)  # type: ignore[arg-type]
    if script == "refuse":
        assert "max_tokens is too large" in info.value.details()  # type: ignore[attr-defined]


def test_generate_once_on_an_unknown_route_is_not_found(
        scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    _, stub = scripted
    req = request("whole", stream=False)
    req.endpoint = "nowhere"
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert error_reason(info.value) == ("model_not_found", "model")  # type: ignore[arg-type]


def test_the_gateway_streams_and_answers_through_both_rpcs(
        stack: Stack, scripted: tuple[ScriptedServer, pb_grpc.EngineProxyStub]) -> None:
    server, _ = scripted
    server.scripts["client"] = [b"".join(EVENTS[:4]), b"".join(EVENTS[4:]) + USAGE_CHUNK + DONE]
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0) as client:
        msgs = [{"role": "user", "content": "client"}]
        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,  # type: ignore[arg-type]
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
        assert all(c.usage is None for c in chunks[:-1])  # running usage stripped, the usage chunk kept
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        whole = client.chat.completions.create(model=MODEL, messages=msgs)  # type: ignore[arg-type]
        assert whole.choices[0].message.content == "whole answer"
        assert whole.usage is not None and whole.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "refuse"}])  # type: ignore[arg-type]
        assert "max_tokens is too large" in str(refused.value)
