"""The route and generate stages: find the endpoint, call engine-proxy (GenerateOnce for a whole
answer, Generate for a stream), send the answer back (whole, or streamed unbuffered: each message,
the chunks one engine read brought, in one write), and settle the call when the answer ends, however
it ends: a stream cut short (the client left, the engine failed) is billed what it delivered (_delivered).
The engine call is the generation span (_span), which ends when the call is settled.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import orjson
from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from examlops.engine import task_of
from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.svc import RouteTable, unroutable_reason

from .._events import events_of, frames
from .._metrics import child
from .._state import GatewayState
from ..governance import Ticket
from ..guardrails import Guard, GuardedCall, GuardrailBlocked
from ._delivered import Delivered
from ._denials import from_block
from ._errors import OpenAIError, from_grpc
from ._span import CLIENT_GONE as GONE_CODE
from ._span import GenerationSpan
from ._streaming import DONE, LeanStream

if TYPE_CHECKING:  # structured output's and the cache's hooks on a stream
    from ..cache import StreamTap
    from ._structured import CheckedStream

REQUESTS = Counter("examlops_gateway_requests_total", "Gateway generation requests.",
                   ["model", "status"])
LATENCY = Histogram("examlops_gateway_request_seconds", "Time to the response head (first chunk).",
                    ["model"], buckets=(0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120))

MEDIA_HEADER = "x-examlops-media-parts-dropped"
WARNING_HEADER = "x-examlops-warning"
CLIENT_GONE = "499"
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID = 256


#: an endpoint's task (generate, embed) by its engine block JSON: parsed once per block, not per call
task_of_block = functools.lru_cache(maxsize=1024)(task_of)

_WRONG_TASK = {
    "embed": "The model '{model}' is a generation route (task generate): /v1/embeddings needs an embedding "
             "route, one whose engine block has task: embed",
    "generate": "The model '{model}' is an embedding route (task embed): call /v1/embeddings; chat and "
                "completions need a route whose engine block has task: generate",
}


def session_id_of(request: Request) -> str:
    """The client's x-session-id header, which engine-proxy's session routing keys on ('' when
    absent): one header of at most MAX_SESSION_ID printable ASCII characters, else a 400 naming it."""
    values = request.headers.getlist(SESSION_HEADER)
    if not values:
        return ""
    value = values[0]
    if len(values) == 1 and len(value) <= MAX_SESSION_ID and value.isascii() and value.isprintable():
        return value
    got = f"{len(values)} headers" if len(values) > 1 else f"{len(value)} characters"
    raise OpenAIError(400, f"the {SESSION_HEADER} header must be one value of at most {MAX_SESSION_ID} printable "
                           f"ASCII characters (got {got})", code="invalid_session_id", param=SESSION_HEADER)


async def route(routes: RouteTable, ticket: Ticket, task: str = "generate") -> None:
    """404 unless the model names a routable endpoint, 400 when it serves another task than the
    API's (an embedding route on chat, a generation route on embeddings); a refused call gives its
    reservation back."""
    model = ticket.model
    ep = routes.get(model)
    if ep is None:
        err = OpenAIError(404, f"The model '{model}' does not exist or is not registered", code="model_not_found",
                          param="model")
    elif (reason := unroutable_reason(ep)) is not None:
        err = OpenAIError(404, f"The model '{model}' is not routed: {reason}", code="model_not_found", param="model")
    elif task_of_block(ep.engine_block_json) != task:
        err = OpenAIError(400, _WRONG_TASK[task].format(model=model), code="model_task_mismatch", param="model")
    else:
        return
    if not ticket.caller.admin:  # the admin key reserved nothing
        await ticket.settle(str(err.status))
    raise err


async def generate(state: GatewayState, kind: int, ticket: Ticket, checked: CheckedStream | None = None,
                   guard: Guard | None = None, tap: StreamTap | None = None, session_id: str = "",
                   req: Any = None) -> Response:
    """engine-proxy.GenerateOnce (a whole answer) or .Generate (a stream); the response settles the
    call once it is sent (or the client leaves).
    `checked`: a stream's structured-output check (_structured.py); `guard`: the call's output
    guardrail (guardrails/), which rewrites or blocks the engine's chunks as they are read; `tap`:
    the response cache's copy of a stream's chunks, told when the stream ended whole (cache/);
    `session_id`: the client's x-session-id (session_id_of), for session routing; `req`: the parsed
    request (its max_tokens and temperature go on the span)."""
    model = ticket.model
    request = pb.GenerateRequest(endpoint=model, kind=kind, body_json=ticket.body,  # type: ignore[arg-type]
                                 session_id=session_id)
    ep = state.routes.get(model)
    span = GenerationSpan(kind, ticket, ep, req)
    stream, timeout = ticket.stream, state.settings.request_timeout_s
    with span.active():  # engine-proxy's call (and the engine's) are the span's children
        call: Any = state.multiplex.call(request, once=not stream, timeout=timeout)
    if guard is not None and stream:
        call = GuardedCall(call, guard, ticket)  # output guardrail: the chunks are read through it
    start = time.perf_counter()
    try:
        if stream:
            first = await call.read()
        else:
            first = await call
            if guard is not None:  # output guardrail: the whole answer is scanned once
                guard.ticket = ticket  # a retried attempt is a new ticket
                first = await guard.check_answer(first)
    except grpc.aio.AioRpcError as exc:
        err = from_grpc(exc, model, admin=ticket.caller.admin)
        child(REQUESTS, model, str(err.status)).inc()
        span.failed(err.code, err.message)
        await span.settle(ticket, str(err.status))
        raise err from None
    except GuardrailBlocked as exc:  # the output guardrail blocked a whole answer: charge what was made
        child(REQUESTS, model, "400").inc()
        span.failed("guardrail_blocked", str(exc))
        await span.settle(ticket, "400", *_made(exc))
        raise
    except BaseException:
        call.cancel()
        span.failed(GONE_CODE, "the client went away before the answer")
        span.settle_later(ticket, CLIENT_GONE)
        raise
    finally:
        child(LATENCY, model).observe(time.perf_counter() - start)
    ticket.first_chunk()
    if first is grpc.aio.EOF:
        child(REQUESTS, model, "502").inc()
        err = OpenAIError(502, f"endpoint:{model} returned nothing", type="AllBackendsFailed",
                          code="all_backends_failed")
        span.failed(err.code, err.message)
        await span.settle(ticket, "502")
        raise err
    span.answered(first, ep)
    ticket.replica = first.replica  # the server a gpu-hour cost is apportioned on (governance)
    headers = _notice_headers(first)
    if guard is not None and guard.fired:
        headers = {**(headers or {}), **guard.headers()}
    child(REQUESTS, model, "200").inc()
    if not stream:
        return _SettledAnswer(first, ticket, headers, span)
    sse = _sse(call, first, ticket, span, state.settings.heartbeat_s, checked, tap)  # notes progress once per heartbeat
    response = _SettledStream(sse, call, first, ticket, headers, span)
    response.write_timeout_s = state.settings.stream_write_timeout_s
    return response


class _SettledAnswer(Response):
    """A whole answer, settled once it is sent (off the latency path); the engine's work is charged
    even if the client is gone by then."""

    def __init__(self, first: pb.GenerateChunk, ticket: Ticket, headers: dict[str, str] | None,
                 span: GenerationSpan) -> None:
        super().__init__(first.data, media_type="application/json", headers=headers)
        self.ticket, self.span = ticket, span
        self.usage = first.usage if first.HasField("usage") else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.span.settle_later(self.ticket, "200", self.usage, None)


class _SettledStream(LeanStream):
    """A stream whose call is settled even when the client leaves before the first chunk is sent."""

    def __init__(self, content: AsyncIterator[bytes], call: Any, first: pb.GenerateChunk, ticket: Ticket,
                 headers: dict[str, str] | None, span: GenerationSpan) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.call, self.first, self.ticket, self.span = call, first, ticket, span

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.ticket.settled:  # _sse never ran: one chunk had come back from the engine
                self.call.cancel()
                made = Delivered()
                made.add(self.first)
                self.span.failed(GONE_CODE, "the client went away during the stream")
                self.span.settle_later(self.ticket, CLIENT_GONE, made.usage, made.beyond)


def _tapped(chunk: pb.GenerateChunk, checked: CheckedStream | None, tap: StreamTap | None) -> bytes:
    """A message's frames through the cache's tap and structured output's hold."""
    events = events_of(chunk)
    if tap is not None:
        for data in events:
            tap.add(data)
    if checked is None:
        return frames(chunk)
    return b"".join([b"data: " + data + b"\n\n" for data in events if not checked.holds(data)])


def _made(exc: GuardrailBlocked) -> tuple[pb.Usage | None, int | None]:
    """What a blocked answer made (its usage), or its bound when the engine gave none."""
    if exc.produced is not None and exc.produced.HasField("usage"):
        return exc.produced.usage, 0
    return None, None


def _notice_headers(first: pb.GenerateChunk) -> dict[str, str] | None:
    """What engine-proxy wants the client to know (dropped media, a degraded engine)."""
    if not first.media_parts_dropped and not first.warnings:
        return None
    headers = {WARNING_HEADER: "; ".join(first.warnings).encode("ascii", "replace").decode()}
    if first.media_parts_dropped:
        headers[MEDIA_HEADER] = str(first.media_parts_dropped)
    return headers


async def _sse(call: Any, first: pb.GenerateChunk, ticket: Ticket, span: GenerationSpan, note_every_s: float,
               checked: CheckedStream | None, tap: StreamTap | None = None) -> AsyncIterator[bytes]:
    """Forward each message as it comes, in one write (its chunks are split only for the cache's
    tap and structured output's check); settle before [DONE], or in the background if the client
    left. A long stream notes what it delivered in its reservation now and then (for the reaper)."""
    chunk = first
    sent = Delivered()
    status, error = "200", b""
    noted = time.monotonic()
    plain = tap is None and checked is None
    try:
        try:
            while True:
                sent.add(chunk)  # counted before it is sent: the client may leave while it is
                out = frames(chunk) if plain else _tapped(chunk, checked, tap)
                if out:
                    yield out
                if chunk.final:
                    break
                if time.monotonic() - noted >= note_every_s:
                    noted = time.monotonic()
                    ticket.note_progress(sent.usage, sent.beyond)
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    break
                if span.recording:
                    span.saw(chunk)
        except grpc.aio.AioRpcError as exc:
            err = from_grpc(exc, ticket.model, admin=ticket.caller.admin)
            span.failed(err.code, err.message)
            status, error = str(err.status), b"data: " + orjson.dumps(err.body()) + b"\n\n"
        except GuardrailBlocked as exc:  # the output guardrail: end the stream with an error event
            call.cancel()
            if exc.produced is not None:
                sent.add(exc.produced)
            span.failed("guardrail_blocked", str(exc))
            status, error = "400", b"data: " + orjson.dumps(from_block(exc).body()) + b"\n\n"
        if checked is not None and not error:  # structured output: the held last chunks, or an error event
            released, status, error = checked.end(status)
            if released:
                yield released
            elif error:
                span.failed("structured_output_invalid", "the answer does not match response_format")
        if tap is not None and status == "200" and not error:
            tap.end(sent.usage)  # the cache keeps the whole answer, in the background
        settling = span.settle_later(ticket, status, sent.usage, sent.beyond)
        if settling is not None:
            await asyncio.shield(settling)
        if error:
            yield error
        yield DONE  # the response sends it with the body's end
    finally:
        if not ticket.settled:  # the client went away mid-stream: stop the engine, charge what was sent
            call.cancel()
            span.failed(GONE_CODE, "the client went away during the stream")
            span.settle_later(ticket, CLIENT_GONE, sent.usage, sent.beyond)
