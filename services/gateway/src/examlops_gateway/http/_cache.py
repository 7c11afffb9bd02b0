"""The response cache on the HTTP path (services/gateway/CACHE.md): the lookup with the request's
Cache-Control, a hit answered in the client's mode (JSON, or SSE replaying the stored answer with
its usage), and a miss's answer handed to the cache once it is whole, with `x-examlops-cache` on
every response of an endpoint that has a policy.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .._state import GatewayState
from ..cache import CacheCall, sse_events
from ..governance import Ticket
from ..guardrails import Guard, GuardrailBlocked
from ..structured import VERDICT_HEADER, StructuredOutput
from ._generate import _SettledAnswer
from ._protocol import GenerationRequest
from ._span import GenerationSpan


async def look_up(request: Request, state: GatewayState, ticket: Ticket, req: GenerationRequest,
                  raw: bytes) -> CacheCall | None:
    """The call's cache outcome (None: no policy applies). `client_bound`: the engine gets the
    output bound the client asked for, not one governance lowered (a truncated answer is kept only then)."""
    client_bound = ticket.caller.admin or ticket.max_tokens == req.output_limit
    return await state.cache.lookup(ticket, raw, request.headers.get("cache-control", ""), client_bound)


async def answer_from_cache(state: GatewayState, kind: int, call: CacheCall, ticket: Ticket, req: GenerationRequest,
                            guard: Guard | None, shape: StructuredOutput | None) -> Response:
    """A hit, settled at no cost, through the call's output guardrails, in the client's mode; its
    generation span says which hit (examlops.cache) and costs 0."""
    span = GenerationSpan(kind, ticket, state.routes.get(ticket.model), req)
    try:
        answer = await state.cache.hit_answer(call, ticket, guard)
    except GuardrailBlocked as exc:
        span.failed("guardrail_blocked", str(exc))
        span.from_cache(ticket, {})
        raise
    span.from_cache(ticket, answer)
    headers = call.headers
    if guard is not None and guard.fired:
        headers.update(guard.headers())
    if shape is not None:
        headers[VERDICT_HEADER] = "valid"  # only answers that met the contract were kept
    if not req.stream:
        return Response(orjson.dumps(answer), media_type="application/json", headers=headers)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return Response(sse_events(answer, usage), media_type="text/event-stream", headers=headers)


def with_cache(response: Response, call: CacheCall | None) -> Response:
    """The cache's header on a generated answer; a whole one is handed to the cache to keep (a
    stream's chunks reach it through its tap)."""
    if call is None:
        return response
    response.headers.update(call.headers)
    if isinstance(response, _SettledAnswer):
        call.keep(bytes(response.body))
    return response
