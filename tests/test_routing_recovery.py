"""Routing promises of the README: DISABLED endpoints are not routed, and traffic resumes by itself.

A recording backend stands in for vLLM, so the tests see whether a request reached the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.recorder import RecordingServer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0) as c:
        yield c


def _outcome(client: openai.OpenAI, model: str) -> str:
    """`ok`, or the error's HTTP status and code/type, e.g. `404 model_not_found`."""
    try:
        reply = client.chat.completions.create(model=model, messages=HI)
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return f"{exc.status_code} {body.get('code') or body.get('type')}: {body.get('message', '')}"
    return "ok" if reply.choices[0].message.content == "recorded" else "wrong answer"


def test_a_disabled_endpoint_is_not_routed_and_says_so(stack: Stack, client: openai.OpenAI) -> None:
    backend = RecordingServer()
    try:
        stack.register("disabled-c", engine="vllm-server", base_url=backend.url)
        wait_until(lambda: _outcome(client, "disabled-c") == "ok", 10, what="the READY endpoint routed")
        seen = len(backend.bodies)
        stack.register("disabled-c", engine="vllm-server", base_url=backend.url, state=reg.ENDPOINT_STATE_DISABLED)
        wait_until(lambda: _outcome(client, "disabled-c").startswith("404 model_not_found"), 10,
                   what="the DISABLED endpoint unrouted")
        assert "DISABLED" in _outcome(client, "disabled-c")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="disabled-c", messages=HI, stream=True)
        assert len(backend.bodies) == seen, "a DISABLED endpoint's server was called"
        assert "disabled-c" not in {m.id for m in client.models.list()}
    finally:
        backend.close()


def test_traffic_resumes_by_itself_when_the_server_comes_back(stack: Stack, client: openai.OpenAI) -> None:
    port = free_port()
    stack.register("resumes-d", engine="vllm-server", base_url=f"http://127.0.0.1:{port}")
    wait_until(lambda: not _outcome(client, "resumes-d").startswith("404"), 10, what="the endpoint routed")
    down = _outcome(client, "resumes-d")
    assert down.startswith("502 all_backends_failed") and "endpoint:resumes-d" in down, down
    backend = RecordingServer(port=port)  # the server is back; nobody runs `exa serve llm health`
    try:
        wait_until(lambda: _outcome(client, "resumes-d") == "ok", 10, 0.2, "traffic resumed")
        listed = stack.registry().ListEndpoints(reg.ListEndpointsRequest(), timeout=10).endpoints
        assert next(e for e in listed if e.name == "resumes-d").state == reg.ENDPOINT_STATE_READY
    finally:
        backend.close()
