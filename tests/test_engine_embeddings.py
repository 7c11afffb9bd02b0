"""Embeddings through engine-proxy's gRPC Generate (REQUEST_KIND_EMBEDDINGS): echo's deterministic
vectors, the route-task checks, and the real all-MiniLM-L6-v2 on CPU vLLM answering as vLLM does."""

from __future__ import annotations

import base64
import json
import math
import struct
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.svc import error_reason
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.plugin import VllmServer

ECHO_EMBED = json.dumps({"engine": "echo", "task": "embed"})
ECHO_GENERATE = json.dumps({"engine": "echo"})


@pytest.fixture(scope="module")
def proxy(stack: Stack) -> Iterator[pb_grpc.EngineProxyStub]:
    stack.register("echo-embed", engine="echo", served_model_name="echo-embed", engine_block_json=ECHO_EMBED)
    stack.register("echo-gen", engine="echo", engine_block_json=ECHO_GENERATE)
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    wait_until(lambda: {"echo-embed", "echo-gen"} <= {r.name for r in stub.ListRoutes(
        pb.ListRoutesRequest(), timeout=5).routes}, 10, what="the echo routes reach engine-proxy")
    yield stub


def call(stub: pb_grpc.EngineProxyStub, endpoint: str, body: dict[str, Any],
         kind: int = pb.REQUEST_KIND_EMBEDDINGS) -> list[pb.GenerateChunk]:
    request = pb.GenerateRequest(endpoint=endpoint, kind=kind, body_json=json.dumps(body).encode())
    return list(stub.Generate(request, timeout=60))


def embed(stub: pb_grpc.EngineProxyStub, endpoint: str, body: dict[str, Any]) -> tuple[dict[str, Any], pb.Usage]:
    chunks = call(stub, endpoint, body)
    assert len(chunks) == 1 and chunks[0].final, "an embeddings call answers in one final message"
    return json.loads(chunks[0].data), chunks[0].usage


def refused(stub: pb_grpc.EngineProxyStub, endpoint: str, body: dict[str, Any],
            kind: int = pb.REQUEST_KIND_EMBEDDINGS) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(stub, endpoint, body, kind)
    return info.value


def unpack(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_echo_answers_openais_shape_with_unit_vectors_and_usage(proxy: pb_grpc.EngineProxyStub) -> None:
    answer, usage = embed(proxy, "echo-embed", {"model": "echo-embed", "input": ["hello there world", "hi"]})
    assert set(answer) == {"object", "data", "model", "usage"} and answer["object"] == "list"
    assert answer["model"] == "echo-embed"
    assert [(d["object"], d["index"]) for d in answer["data"]] == [("embedding", 0), ("embedding", 1)]
    for item in answer["data"]:
        assert len(item["embedding"]) == 384
        assert math.isclose(math.fsum(v * v for v in item["embedding"]), 1.0, rel_tol=1e-5)
    assert answer["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 0)
    first, second = (d["embedding"] for d in answer["data"])
    assert abs(cosine(first, second)) < 0.3  # different inputs: nearly orthogonal


def test_echo_vectors_are_deterministic_per_input(proxy: pb_grpc.EngineProxyStub) -> None:
    alone, _ = embed(proxy, "echo-embed", {"input": "the same words"})
    batch, _ = embed(proxy, "echo-embed", {"input": ["other", "the same words"]})
    assert alone["data"][0]["embedding"] == batch["data"][1]["embedding"]
    assert batch["data"][0]["embedding"] != batch["data"][1]["embedding"]


def test_echo_takes_token_arrays_dimensions_and_base64(proxy: pb_grpc.EngineProxyStub) -> None:
    tokens, usage = embed(proxy, "echo-embed", {"input": [[101, 7592, 102], [5, 6]]})
    assert usage.prompt_tokens == 5 and len(tokens["data"]) == 2
    single, _ = embed(proxy, "echo-embed", {"input": [101, 7592, 102]})  # one token array
    assert single["data"][0]["embedding"] == tokens["data"][0]["embedding"]
    floats, _ = embed(proxy, "echo-embed", {"input": "dims", "dimensions": 64})
    encoded, _ = embed(proxy, "echo-embed", {"input": "dims", "dimensions": 64, "encoding_format": "base64"})
    assert len(floats["data"][0]["embedding"]) == 64
    assert unpack(encoded["data"][0]["embedding"]) == floats["data"][0]["embedding"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", 3]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
])
def test_echo_refuses_bad_requests_naming_the_field(proxy: pb_grpc.EngineProxyStub, body: dict[str, Any],
                                                    param: str) -> None:
    error = refused(proxy, "echo-embed", body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error_reason(error) == ("engine_rejected", param)  # type: ignore[arg-type]


def test_a_route_answers_only_calls_of_its_task(proxy: pb_grpc.EngineProxyStub) -> None:
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    for endpoint, body, kind, says in [
        ("echo-gen", {"input": "hi"}, pb.REQUEST_KIND_EMBEDDINGS, "'echo-gen' is a generation route (task: generate)"),
        ("echo-embed", chat, pb.REQUEST_KIND_CHAT, "'echo-embed' is an embedding route (task: embed)"),
        ("echo-embed", {"prompt": "hello"}, pb.REQUEST_KIND_COMPLETION, "completions call"),
    ]:
        error = refused(proxy, endpoint, body, kind)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert error_reason(error) == ("model_task_mismatch", "model")  # type: ignore[arg-type]
        assert says in (error.details() or "")  # type: ignore[attr-defined]
    (chunk,) = call(proxy, "echo-gen", chat, pb.REQUEST_KIND_CHAT)  # its own task still answers
    assert json.loads(chunk.data)["choices"][0]["message"]["content"] == "echo: hello"


def vllm_embeddings(server: VllmServer, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(server.base_url + "/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


@pytest.mark.vllm
def test_real_minilm_through_engine_proxy_equals_vllms_own_answer(stack: Stack, minilm_vllm: VllmServer) -> None:
    block = json.dumps({"engine": "vllm-server", "task": "embed", "served_model_name": "minilm",
                        "hf_model_id": "sentence-transformers/all-MiniLM-L6-v2"})
    stack.register("minilm-real", engine="vllm-server", base_url=minilm_vllm.base_url,
                   served_model_name=minilm_vllm.served_model_name, engine_block_json=block)
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    wait_until(lambda: "minilm-real" in {r.name for r in stub.ListRoutes(pb.ListRoutesRequest(), timeout=5).routes},
               10, what="the minilm route reaches engine-proxy")
    texts = ["A cat sits on the mat.", "Quarterly revenue grew by four percent."]
    answer, usage = embed(stub, "minilm-real", {"model": "minilm-real", "input": texts})
    direct = vllm_embeddings(minilm_vllm, {"model": "minilm", "input": texts})
    assert [len(d["embedding"]) for d in answer["data"]] == [384, 384]
    for ours, theirs in zip(answer["data"], direct["data"], strict=True):
        assert cosine(ours["embedding"], theirs["embedding"]) >= 0.999
    assert usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0 and usage.completion_tokens == 0
    encoded, _ = embed(stub, "minilm-real", {"input": texts[0], "encoding_format": "base64"})
    assert cosine(unpack(encoded["data"][0]["embedding"]), direct["data"][0]["embedding"]) >= 0.999
    error = refused(stub, "minilm-real", {"input": "x", "dimensions": 64})  # not a Matryoshka model
    assert error_reason(error)[0] == "engine_rejected"  # type: ignore[arg-type]
    chat = refused(stub, "minilm-real", {"messages": [{"role": "user", "content": "hi"}]}, pb.REQUEST_KIND_CHAT)
    assert error_reason(chat)[0] == "model_task_mismatch"  # type: ignore[arg-type]
