"""The client's x-session-id header: the gateway checks it and forwards it to engine-proxy as
GenerateRequest.session_id, which session routing keys on (the OpenAI `user` field travels in the body).

Accepting and refusing run against the real stack (echo engine). What crosses to engine-proxy is
seen by a gateway process pointed at a recording EngineProxy servicer, since engine-proxy reports
no session id of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, wait_until

MODEL = "session-echo"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello session"}]


class RecordingEngineProxy(ep_grpc.EngineProxyServicer):
    """Records every GenerateRequest and answers it with one small chat or completion."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        self.requests.append(request)
        body = orjson.loads(request.body_json)
        chat = request.kind == pb.REQUEST_KIND_CHAT
        choice = ({"index": 0, "delta" if body.get("stream") else "message": {"role": "assistant", "content": "ok"}}
                  if chat else {"index": 0, "text": "ok"})
        obj = "chat.completion" if chat else "text_completion"
        answer = {"id": "rec-1", "object": obj + (".chunk" if body.get("stream") and chat else ""), "created": 0,
                  "model": request.endpoint, "choices": [{**choice, "finish_reason": "stop"}]}
        yield pb.GenerateChunk(data=orjson.dumps(answer), final=True,
                               usage=pb.Usage(prompt_tokens=2, completion_tokens=1))

    def GenerateOnce(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateChunk:
        """A whole answer (the gateway's non-streamed calls): Generate's one message."""
        (answer,) = self.Generate(request, context)
        return answer

    def Multiplex(self, requests: Iterator[pb.MultiplexRequest],
                context: grpc.ServicerContext) -> Iterator[pb.MultiplexReply]:
        """The gateway's calls on one stream, answered one after the other."""
        for message in requests:
            if message.cancel:
                continue
            for chunk in self.Generate(message.request, context):
                yield pb.MultiplexReply(id=message.id, chunk=chunk, end=message.once)
            if not message.once:
                yield pb.MultiplexReply(id=message.id, end=True)


def _routable(url: str, name: str) -> bool:
    resp = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"})
    return resp.status_code == 200 and any(m["id"] == name for m in resp.json()["data"])


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    """The stack's own gateway, engine-proxy and echo engine."""
    stack.register(MODEL, engine="echo")
    wait_until(lambda: _routable(stack.gateway_url, MODEL), what=f"{MODEL} routable")
    c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def recorded(stack: Stack, client: openai.OpenAI) -> Iterator[tuple[openai.OpenAI, RecordingEngineProxy]]:
    """A second gateway of the stack whose engine-proxy is the recording servicer."""
    servicer = RecordingEngineProxy()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ep_grpc.add_EngineProxyServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _, url = stack.start_gateway_replica("gateway-session", {"EXAMLOPS_ENGINE_PROXY_ADDR": f"127.0.0.1:{port}"})
        wait_until(lambda: _routable(url, MODEL), what=f"{MODEL} routable on gateway-session")
        c = openai.OpenAI(base_url=url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        yield c, servicer
        c.close()
    finally:
        stack.stop("gateway-session")
        server.stop(None)


def _sent(servicer: RecordingEngineProxy) -> pb.GenerateRequest:
    assert servicer.requests, "engine-proxy got no call"
    return servicer.requests.pop()


def test_the_header_reaches_engine_proxy_as_session_id_for_chat_stream_and_completions(
        recorded: tuple[openai.OpenAI, RecordingEngineProxy]) -> None:
    c, servicer = recorded
    session = "conv-42:" + "A" * 248  # 256 printable characters, the longest accepted
    resp = c.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers={"x-session-id": session})
    assert resp.choices[0].message.content == "ok"
    sent = _sent(servicer)
    assert sent.session_id == session and sent.kind == pb.REQUEST_KIND_CHAT and sent.endpoint == MODEL

    chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            extra_headers={"X-Session-Id": "s-stream"}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "ok"
    assert _sent(servicer).session_id == "s-stream"  # header names are case-insensitive

    done = c.completions.create(model=MODEL, prompt="hi", extra_headers={"x-session-id": "s-completion"})
    assert done.choices[0].text == "ok"
    sent = _sent(servicer)
    assert sent.session_id == "s-completion" and sent.kind == pb.REQUEST_KIND_COMPLETION


def test_without_the_header_no_session_is_sent_and_the_user_field_stays_in_the_body(
        recorded: tuple[openai.OpenAI, RecordingEngineProxy]) -> None:
    c, servicer = recorded
    c.chat.completions.create(model=MODEL, messages=MESSAGES, user="alice")
    sent = _sent(servicer)
    assert sent.session_id == "" and orjson.loads(sent.body_json)["user"] == "alice"
    c.completions.create(model=MODEL, prompt="hi", user="bob")
    sent = _sent(servicer)
    assert sent.session_id == "" and orjson.loads(sent.body_json)["user"] == "bob"


def test_the_stack_answers_with_a_session_header(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          extra_headers={"x-session-id": "conv-1"}, user="alice")
    assert resp.choices[0].message.content == "echo: hello session"


REFUSAL = "the x-session-id header must be one value of at most 256 printable ASCII characters (got {got})"


def test_a_too_long_session_header_is_refused_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       extra_headers={"x-session-id": "x" * 257})
    err = caught.value
    assert err.status_code == 400 and err.code == "invalid_session_id" and err.param == "x-session-id"
    assert isinstance(err.body, dict) and err.body["type"] == "invalid_request_error"
    assert REFUSAL.format(got="257 characters") in err.message


def _post_raw(stack: Stack, *session: bytes) -> httpx.Response:
    """A chat call with raw header bytes the openai client will not send (it encodes headers as ASCII)."""
    headers = [(b"authorization", f"Bearer {DEFAULT_ADMIN_KEY}".encode()), *((b"x-session-id", v) for v in session)]
    return httpx.post(stack.gateway_url + "/v1/chat/completions", headers=headers,
                      json={"model": MODEL, "messages": MESSAGES})


@pytest.mark.parametrize(("session", "got"), [
    ((b"caf\xe9",), "4 characters"),            # not ASCII (HTTP's obs-text, which the server lets through)
    ((b"a\tb",), "3 characters"),               # a tab: valid in a header, not printable
    ((b"a", b"b"), "2 headers"),                 # which one would route?
])
def test_a_session_header_that_is_not_one_printable_ascii_value_is_refused(
        stack: Stack, client: openai.OpenAI, session: tuple[bytes, ...], got: str) -> None:
    resp = _post_raw(stack, *session)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"message": REFUSAL.format(got=got), "type": "invalid_request_error",
                                    "code": "invalid_session_id", "param": "x-session-id"}


def test_a_control_character_never_reaches_the_gateway(stack: Stack, client: openai.OpenAI) -> None:
    # The HTTP server itself refuses a header value with a control character other than tab.
    assert _post_raw(stack, b"a\x01b").status_code == 400


def test_the_key_is_checked_before_the_header(stack: Stack, client: openai.OpenAI) -> None:
    bad = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES,
                                    extra_headers={"x-session-id": "x" * 300})
    bad.close()
