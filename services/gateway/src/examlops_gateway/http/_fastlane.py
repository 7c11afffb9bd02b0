"""The fast lane: the generation and embedding routes dispatched without FastAPI's per-request stack.

A POST to /v1/chat/completions, /v1/completions or /v1/embeddings goes straight to its handler
(_pipeline.serve_generation, _embeddings.serve_embeddings) with the caller identified by
_deps.caller, as FastAPI would resolve it; every other request (a GET on those paths, the admin
API, probes, /metrics, the OpenAPI document, an unknown path) goes through FastAPI. Errors get the
response FastAPI's handlers give them (_denials.error_response): before the response started, the
error's OpenAI body; an unexpected exception answers 500 and is raised on, for the server to log.
With tracing on, a lane request gets the SERVER span FastAPI's telemetry would give it (`POST
/v1/chat/completions`, child of the client's `traceparent`, current while the request is handled,
ended once the whole response is sent, ERROR on a 5xx) from `_serve_traced`, without FastAPI's stack.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.svc import tracing_enabled

from .._state import GatewayState
from ._denials import HANDLED, error_response
from ._deps import caller
from ._embeddings import serve_embeddings
from ._pipeline import serve_generation
from ._protocol import ChatCompletionRequest, CompletionRequest
from ._span import tracer

Lane = Callable[[Request, GatewayState], Awaitable[Response]]


async def _chat(request: Request, state: GatewayState) -> Response:
    return await serve_generation(request, state, await caller(request, state), pb.REQUEST_KIND_CHAT,
                                  ChatCompletionRequest)


async def _completions(request: Request, state: GatewayState) -> Response:
    return await serve_generation(request, state, await caller(request, state), pb.REQUEST_KIND_COMPLETION,
                                  CompletionRequest)


async def _embeddings(request: Request, state: GatewayState) -> Response:
    return await serve_embeddings(request, state, await caller(request, state))


#: the routes of _openai.py that take the fast lane (the same handlers, the same order of stages)
LANES: dict[str, Lane] = {"/v1/chat/completions": _chat, "/v1/completions": _completions,
                          "/v1/embeddings": _embeddings}


class FastLaneApp(FastAPI):
    """FastAPI, with the hot routes (`lanes`, by default LANES) dispatched directly while tracing is off."""

    def __init__(self, *args: Any, lanes: Mapping[str, Lane] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lanes = LANES if lanes is None else lanes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path")
                or (lane := self.lanes.get(scope["path"])) is None):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        if tracing_enabled():
            await self._serve_traced(lane, scope, receive, send)
        else:
            await self._serve(lane, scope, receive, send)

    async def _serve_traced(self, lane: Lane, scope: Scope, receive: Receive, send: Send) -> None:
        """`_serve` inside the request's SERVER span, named and attributed as FastAPI's telemetry does."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        route = scope["path"]
        attributes = {"http.request.method": "POST", "http.route": route, "url.path": route,
                      "url.scheme": scope.get("scheme", "http"),
                      "network.protocol.version": scope.get("http_version", "")}
        span = tracer.start_span(f"POST {route}", context=propagate.extract(headers), kind=SpanKind.SERVER,
                                 attributes=attributes)
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
            await send(message)

        with trace.use_span(span, end_on_exit=True):  # an exception is recorded on it, as an ERROR
            await self._serve(lane, scope, receive, sending)
            if status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))

    async def _serve(self, lane: Lane, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await lane(request, self.state.gateway)
        except Exception as exc:
            await error_response(exc)(scope, receive, send)
            if not isinstance(exc, HANDLED):
                raise  # as FastAPI's ServerErrorMiddleware does: the server logs it
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await response(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, send)
            if not isinstance(exc, HANDLED):
                raise

