"""A scripted vllm-server for engine-proxy's stream tests: it writes a chat stream in the writes a test
lists, waiting for the test's signal between writes, so a test sees exactly what each network read
of engine-proxy's carried."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops_testsupport._http_stub import StubHandler, ThreadedStub
from examlops_testsupport.fixtures import Stack, wait_until

MODEL = "scripted"
PROMPT = 9
WORDS = [f" w{i}" for i in range(7)]  # with the role chunk: 8 events


def vllm_json(obj: dict[str, Any]) -> bytes:
    """Compact JSON, as vLLM writes its chunks."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def chunk(i: int, text: str, usage: bool = True) -> bytes:
    """Event i of a chat stream with vLLM's continuous usage (the running usage, last key)."""
    delta = {"role": "assistant", "content": ""} if i == 0 else {"content": text}
    obj: dict[str, Any] = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                           "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                        "finish_reason": "stop" if i == len(WORDS) else None}]}
    if usage:
        obj["usage"] = {"prompt_tokens": PROMPT, "total_tokens": PROMPT + i, "completion_tokens": i}
    return b"data: " + vllm_json(obj) + b"\n\n"


EVENTS = [chunk(0, "")] + [chunk(i + 1, w) for i, w in enumerate(WORDS)]
USAGE_CHUNK = b"data: " + vllm_json({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1,
                                     "model": MODEL, "choices": [], "usage": {"prompt_tokens": PROMPT,
                                     "total_tokens": PROMPT + 7, "completion_tokens": 7}}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
WHOLE = vllm_json({"id": "chatcmpl-w", "object": "chat.completion", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "whole answer"},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": PROMPT, "completion_tokens": 2, "total_tokens": PROMPT + 2}})


class ScriptedServer(ThreadedStub):
    """POST: a stream of the writes `scripts[<the first message's content>]` lists (a threading.Event
    is waited for between writes; the last write carries the body's end), or WHOLE without stream;
    a first message "refuse" gets a 400."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[bytes | threading.Event]] = {}
        server = self

        class Handler(StubHandler):
            def do_GET(self) -> None:
                self.send_whole(200, b"", None)

            def do_POST(self) -> None:
                req = self.read_json()
                name = req["messages"][0]["content"]
                if name == "refuse":
                    self.send_whole(400, b'{"error":{"message":"max_tokens is too large"}}', "application/json")
                    return
                if not req.get("stream"):
                    self.send_whole(200, WHOLE, "application/json")
                    return
                steps = server.scripts[name]
                self.start_stream()
                for n, step in enumerate(steps):
                    if isinstance(step, threading.Event):
                        assert step.wait(30), "the test never said go"
                        continue
                    frame = b"%x\r\n%s\r\n" % (len(step), step)
                    self.wfile.write(frame + (b"0\r\n\r\n" if n == len(steps) - 1 else b""))  # one write

        self._listen(Handler, 0)


def stripped(event: bytes) -> bytes:
    """The event as a client that did not ask for usage stats gets it (usage removed from the JSON)."""
    obj = json.loads(event[6:])
    obj.pop("usage", None)
    return b"data: " + vllm_json(obj) + b"\n\n"


def chat_request(model: str, script: str, stream: bool = True) -> pb.GenerateRequest:
    """engine-proxy's request for a chat whose first message names the script to play."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": script}], "stream": stream}
    return pb.GenerateRequest(endpoint=model, kind=pb.REQUEST_KIND_CHAT, body_json=json.dumps(body).encode())


def routed(stub: pb_grpc.EngineProxyStub, model: str) -> bool:
    """Whether engine-proxy routes `model` yet (a whole answer comes back; NOT_FOUND: not yet)."""
    try:
        stub.GenerateOnce(chat_request(model, "whole", stream=False), timeout=10)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
            return False
        raise
    return True


@contextlib.contextmanager
def scripted_route(stack: Stack, model: str) -> Iterator[tuple[ScriptedServer, pb_grpc.EngineProxyStub]]:
    """A ScriptedServer registered as vllm-server endpoint `model`, once the stack's engine-proxy routes it."""
    server = ScriptedServer()
    server.scripts["ping"] = [b"".join(EVENTS) + DONE]
    stack.register(model, engine="vllm-server", base_url=server.url,
                   engine_block_json=json.dumps({"engine": "vllm", "hf_model_id": "org/m"}))
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    wait_until(functools.partial(routed, stub, model), 10, what=f"engine-proxy routes {model}")
    try:
        yield server, stub
    finally:
        server.close()


#: What a module's `scripted` fixture gives: the server, and a stub of the stack's engine-proxy.
Scripted = tuple[ScriptedServer, pb_grpc.EngineProxyStub]


def module_route(model: str) -> tuple[Callable[..., pb.GenerateRequest], Any]:
    """For a test module: its requests to `model` (chat_request's), and a module-scoped `scripted`
    fixture that is scripted_route(stack, model)."""
    @pytest.fixture(scope="module")
    def scripted(stack: Stack) -> Iterator[Scripted]:
        with scripted_route(stack, model) as parts:
            yield parts
    return functools.partial(chat_request, model), scripted
