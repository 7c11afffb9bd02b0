"""The fast lane answers every error as FastAPI's handlers do, and leaves every other request to FastAPI."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi import Request
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException
from starlette.responses import Response

from examlops_gateway.governance import Denied, GovernanceUnavailable
from examlops_gateway.guardrails import GuardrailBlocked, PolicyError
from examlops_gateway.http import FastLaneApp, OpenAIError, install_error_handlers
from examlops_gateway.http._fastlane import LANES

ERRORS: dict[str, Callable[[], Exception]] = {
    "openai": lambda: OpenAIError(401, "no key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
    "denied": lambda: Denied("rpm_exceeded", "7", key_id="k1", model="m"),
    "revoked": lambda: Denied("key_revoked", "", key_id="k1", model="m"),
    "unavailable": lambda: GovernanceUnavailable(ConnectionError("down")),
    "blocked": lambda: GuardrailBlocked("p", "regex", "secret", "input", "messages[0].content"),
    "policy": lambda: PolicyError("detectors", "unknown detector"),
    "http": lambda: HTTPException(418, "teapot"),
    "unexpected": lambda: RuntimeError("boom"),
}


def app_raising(where: str) -> FastLaneApp:
    """The same exception raised from a fast-lane handler (/lane/<name>), from a response the lane
    returned (/late/<name>), and from a FastAPI route (/api/<name>)."""

    async def lane(request: Request, _state: object) -> Response:
        raise ERRORS[request.url.path.rsplit("/", 1)[1]]()

    class Late(Response):
        name = ""

        async def __call__(self, scope: object, receive: object, send: object) -> None:
            raise ERRORS[self.name]()

    async def late(request: Request, _state: object) -> Response:
        response = Late()
        response.name = request.url.path.rsplit("/", 1)[1]
        return response

    app = FastLaneApp(lanes={f"/{where}/{n}": lane if where == "lane" else late for n in ERRORS})
    app.state.gateway = None
    install_error_handlers(app)

    @app.post("/api/{name}")
    async def api(name: str) -> Response:
        raise ERRORS[name]()

    return app


@pytest.mark.parametrize("name", sorted(ERRORS))
@pytest.mark.parametrize("where", ["lane", "late"])
def test_an_error_on_the_fast_lane_is_answered_as_fastapi_answers_it(name: str, where: str) -> None:
    client = TestClient(app_raising(where), raise_server_exceptions=False)
    fast, slow = client.post(f"/{where}/{name}"), client.post(f"/api/{name}")
    assert fast.status_code == slow.status_code and fast.status_code >= 400
    assert fast.content == slow.content and fast.json()["error"]["message"]
    assert sorted(fast.headers.items()) == sorted(slow.headers.items())


def test_an_unexpected_error_is_raised_on_for_the_server_to_log() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        TestClient(app_raising("lane")).post("/lane/unexpected")


def test_only_a_post_to_a_lane_takes_it() -> None:
    client = TestClient(app_raising("lane"), raise_server_exceptions=False)
    assert client.get("/lane/denied").json()["error"]["code"] == "not_found"  # FastAPI's answer: no such route
    assert client.get("/api/denied").json()["error"]["code"] == "method_not_allowed"
    assert client.post("/lane/denied").status_code == 429
    assert client.post("/elsewhere").json()["error"]["code"] == "not_found"
    assert set(LANES) == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}
