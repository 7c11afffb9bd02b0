"""The OpenAI-compatible surface: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from fastapi import APIRouter
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from examlops.engineproxy.v1 import engineproxy_pb2 as pb
from examlops.svc import unroutable_reason

from ._auth import authenticate
from ._body import read_body
from ._errors import OpenAIError, from_grpc, from_validation
from ._protocol import ChatCompletionRequest, CompletionRequest
from ._state import GatewayState

router = APIRouter()

REQUESTS = Counter("examlops_gateway_requests_total", "Gateway generation requests.",
                   ["model", "status"])
LATENCY = Histogram("examlops_gateway_request_seconds", "Time to the response head (first chunk).",
                    ["model"], buckets=(0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120))

MEDIA_HEADER = "x-examlops-media-parts-dropped"
WARNING_HEADER = "x-examlops-warning"


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def _route(state: GatewayState, model: str) -> None:
    ep = state.routes.get(model)
    if ep is None:
        raise OpenAIError(404, f"The model '{model}' does not exist or is not registered",
                          code="model_not_found", param="model")
    reason = unroutable_reason(ep)
    if reason is not None:
        raise OpenAIError(404, f"The model '{model}' is not routed: {reason}", code="model_not_found",
                          param="model")


async def _parse(request: Request, state: GatewayState, model_cls: type[BaseModel]) -> tuple[bytes, Any]:
    authenticate(request, state)
    raw = await read_body(request, state.settings.max_body_bytes)
    try:
        parsed = model_cls.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0].get("type") == "json_invalid":
            raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
        raise from_validation(exc) from None
    return raw, parsed


async def _generate(state: GatewayState, kind: int, raw: bytes, model: str, stream: bool) -> Response:
    _route(state, model)
    call = state.engine_proxy.Generate(pb.GenerateRequest(endpoint=model, kind=kind, body_json=raw),
                                       timeout=state.settings.request_timeout_s)
    start = time.perf_counter()
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        err = from_grpc(exc, model)
        REQUESTS.labels(model, str(err.status)).inc()
        raise err from None
    finally:
        LATENCY.labels(model).observe(time.perf_counter() - start)
    if first is grpc.aio.EOF:
        REQUESTS.labels(model, "502").inc()
        raise OpenAIError(502, f"endpoint:{model} returned nothing", type="AllBackendsFailed",
                          code="all_backends_failed")
    headers = _notice_headers(first)
    REQUESTS.labels(model, "200").inc()
    if not stream:
        return Response(first.data, media_type="application/json", headers=headers)
    return StreamingResponse(_sse(call, first, model), media_type="text/event-stream", headers=headers)


def _notice_headers(first: pb.GenerateChunk) -> dict[str, str] | None:
    """What engine-proxy wants the client to know (dropped media, a degraded engine)."""
    if not first.media_parts_dropped and not first.warnings:
        return None
    headers = {WARNING_HEADER: "; ".join(first.warnings).encode("ascii", "replace").decode()}
    if first.media_parts_dropped:
        headers[MEDIA_HEADER] = str(first.media_parts_dropped)
    return headers


async def _sse(call: Any, first: pb.GenerateChunk, model: str) -> AsyncIterator[bytes]:
    chunk = first
    try:
        while True:
            if chunk.data:
                yield b"data: " + chunk.data + b"\n\n"
            if chunk.final:
                break
            chunk = await call.read()
            if chunk is grpc.aio.EOF:
                break
    except grpc.aio.AioRpcError as exc:
        yield b"data: " + orjson.dumps(from_grpc(exc, model).body()) + b"\n\n"
    yield b"data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    raw, req = await _parse(request, state, ChatCompletionRequest)
    return await _generate(state, pb.REQUEST_KIND_CHAT, raw, req.model, req.stream)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    raw, req = await _parse(request, state, CompletionRequest)
    return await _generate(state, pb.REQUEST_KIND_COMPLETION, raw, req.model, req.stream)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    authenticate(request, state)
    data = [{"id": ep.name, "object": "model", "created": ep.created_at_ms // 1000,
             "owned_by": ep.project or "examlops"}
            for ep in sorted(state.routes.routable(), key=lambda e: e.name)]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
