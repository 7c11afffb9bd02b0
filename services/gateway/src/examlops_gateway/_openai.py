"""The OpenAI-compatible surface: /v1/chat/completions, /v1/completions, /v1/models.

A generation: identify the key (no I/O) → parse → admit (one Redis round trip: key, allow-list,
rate limits, budget reservation) → route → engine-proxy.Generate → settle (one round trip: real
cost, cost record). A call that fails or loses its client is settled for what it produced.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import orjson
import redis.asyncio as redis
from fastapi import APIRouter
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from examlops.engineproxy.v1 import engineproxy_pb2 as pb
from examlops.svc import unroutable_reason

from ._auth import identify
from ._body import read_body
from ._errors import OpenAIError, from_grpc, from_validation
from ._governor import Caller, Ticket, denial
from ._keys import redis_keys
from ._protocol import ChatCompletionRequest, CompletionRequest
from ._state import GatewayState

router = APIRouter()

REQUESTS = Counter("examlops_gateway_requests_total", "Gateway generation requests.",
                   ["model", "status"])
LATENCY = Histogram("examlops_gateway_request_seconds", "Time to the response head (first chunk).",
                    ["model"], buckets=(0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120))

MEDIA_HEADER = "x-examlops-media-parts-dropped"
WARNING_HEADER = "x-examlops-warning"
CLIENT_GONE = "499"


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
    raw = await read_body(request, state.settings.max_body_bytes)
    try:
        parsed = model_cls.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0].get("type") == "json_invalid":
            raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
        raise from_validation(exc) from None
    return raw, parsed


async def _handle(request: Request, kind: int, model_cls: type[BaseModel]) -> Response:
    started = time.perf_counter()
    state = _state(request)
    caller = identify(request, state)
    raw, req = await _parse(request, state, model_cls)
    ticket = await state.governor.admit(caller, req, raw, started)
    try:
        _route(state, req.model)
    except OpenAIError as err:
        if not caller.admin:  # give the reservation back; the admin key reserved nothing
            await ticket.settle(str(err.status), None, 0, req.stream)
        raise
    return await _generate(state, kind, ticket, req.stream)


async def _generate(state: GatewayState, kind: int, ticket: Ticket, stream: bool) -> Response:
    model = ticket.model
    request = pb.GenerateRequest(endpoint=model, kind=kind, body_json=ticket.body)  # type: ignore[arg-type]
    call = state.engine_proxy.Generate(request,
                                       timeout=state.settings.request_timeout_s)
    start = time.perf_counter()
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        err = from_grpc(exc, model)
        REQUESTS.labels(model, str(err.status)).inc()
        await ticket.settle(str(err.status), None, 0, stream)
        raise err from None
    except BaseException:
        call.cancel()
        ticket.settle_later(CLIENT_GONE, None, 0, stream)
        raise
    finally:
        LATENCY.labels(model).observe(time.perf_counter() - start)
    ticket.first_chunk()
    if first is grpc.aio.EOF:
        REQUESTS.labels(model, "502").inc()
        await ticket.settle("502", None, 0, stream)
        raise OpenAIError(502, f"endpoint:{model} returned nothing", type="AllBackendsFailed",
                          code="all_backends_failed")
    headers = _notice_headers(first)
    REQUESTS.labels(model, "200").inc()
    if not stream:
        return _SettledAnswer(first, ticket, headers)
    return _SettledStream(_sse(call, first, ticket), call, ticket, headers)


class _SettledAnswer(Response):
    """A whole answer, settled once it is sent (off the latency path); the engine's work is charged
    even if the client is gone by then."""

    def __init__(self, first: pb.GenerateChunk, ticket: Ticket, headers: dict[str, str] | None) -> None:
        super().__init__(first.data, media_type="application/json", headers=headers)
        self.ticket = ticket
        self.usage = first.usage if first.HasField("usage") else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.settle_later("200", self.usage, None, False)


class _SettledStream(StreamingResponse):
    """A stream whose call is settled even when the client leaves before the first chunk is sent."""

    def __init__(self, content: AsyncIterator[bytes], call: Any, ticket: Ticket,
                 headers: dict[str, str] | None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.call, self.ticket = call, ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.ticket.settled:  # _sse never ran: one chunk had come back from the engine
                self.call.cancel()
                self.ticket.settle_later(CLIENT_GONE, None, 1, True)


def _notice_headers(first: pb.GenerateChunk) -> dict[str, str] | None:
    """What engine-proxy wants the client to know (dropped media, a degraded engine)."""
    if not first.media_parts_dropped and not first.warnings:
        return None
    headers = {WARNING_HEADER: "; ".join(first.warnings).encode("ascii", "replace").decode()}
    if first.media_parts_dropped:
        headers[MEDIA_HEADER] = str(first.media_parts_dropped)
    return headers


async def _sse(call: Any, first: pb.GenerateChunk, ticket: Ticket) -> AsyncIterator[bytes]:
    """Forward chunks as they come; settle before [DONE], or in the background if the client left."""
    chunk = first
    produced = 0
    status, usage, error = "200", None, b""
    try:
        try:
            while True:
                if chunk.data:
                    produced += 1
                    yield b"data: " + chunk.data + b"\n\n"
                if chunk.final:
                    usage = chunk.usage if chunk.HasField("usage") else None
                    break
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    break
        except grpc.aio.AioRpcError as exc:
            err = from_grpc(exc, ticket.model)
            status, error = str(err.status), b"data: " + orjson.dumps(err.body()) + b"\n\n"
        settling = ticket.settle_later(status, usage, produced, True)
        if settling is not None:
            await asyncio.shield(settling)
        if error:
            yield error
        yield b"data: [DONE]\n\n"
    finally:
        if not ticket.settled:  # the client went away mid-stream: stop the engine, charge what it made
            call.cancel()
            ticket.settle_later(CLIENT_GONE, None, produced, True)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _handle(request, pb.REQUEST_KIND_CHAT, ChatCompletionRequest)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _handle(request, pb.REQUEST_KIND_COMPLETION, CompletionRequest)


async def _allowed_models(state: GatewayState, caller: Caller) -> set[str] | None:
    """None for the admin key; a virtual key's allow-list once the key checks out."""
    if caller.admin:
        return None
    try:
        f = cast(list[str | None], await state.redis.hmget(
            redis_keys(caller.key_id)[0], ["hash", "revoked_ms", "expires_ms", "models"]))
    except redis.RedisError as exc:
        raise OpenAIError(503, f"the governance store (Redis) is unavailable: {type(exc).__name__}",
                          type="service_unavailable", code="governance_unavailable") from None
    if not f[0] or not hmac.compare_digest(f[0], caller.key_hash):
        raise denial("invalid_api_key", "", caller.key_id, "")
    if int(f[1] or 0):
        raise denial("key_revoked", "", caller.key_id, "")
    expires = int(f[2] or 0)
    if expires and expires <= time.time() * 1000:
        raise denial("key_expired", "", caller.key_id, "")
    return {m for m in (f[3] or "").split(",") if m}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    allowed = await _allowed_models(state, identify(request, state))
    data = [{"id": ep.name, "object": "model", "created": ep.created_at_ms // 1000,
             "owned_by": ep.project or "examlops"}
            for ep in sorted(state.routes.routable(), key=lambda e: e.name)
            if allowed is None or ep.name in allowed]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
