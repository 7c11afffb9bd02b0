"""The request path of a generation, in one function: its stages in hot-path order.

Each stage lives in its wing: auth (_deps.caller, resolved before the handler runs, by the fast
lane (_fastlane) or by FastAPI, then governance.KeyCheck: a virtual key must exist and be valid
before its body is read), parse (_body), admit (governance: key, allow-list, rate limits, budget
reservation, one Redis round trip), guard (guardrails.GuardStage: the input scan; its Guard watches
the answer too), route, cache (_cache: under an endpoint's cache policy, a hit answers without the
engine, a miss's whole answer is kept), generate (_generate), settle (governance.Ticket, called by
the response when the answer ends, however it ends: one Redis round trip). Structured output
(_structured) checks a response_format's schema at parse and the answers after generate, retrying
an invalid whole answer through a new admission.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from .._state import GatewayState
from ..governance import Caller
from ._body import parse_body
from ._cache import answer_from_cache, look_up, with_cache
from ._generate import route, session_id_of
from ._protocol import GenerationRequest, check_request
from ._structured import generate_checked, structured_output


async def serve_generation(request: Request, state: GatewayState, caller: Caller, kind: int,
                           schema: type[GenerationRequest]) -> Response:
    # auth: `caller` is _deps.caller's answer, resolved before this runs (_fastlane, or FastAPI's CallerDep)
    started = time.perf_counter()
    await state.key_check.check(caller)                                          # auth: before the body
    session_id = session_id_of(request)                                          # parse: x-session-id
    s = state.settings
    raw, req = await parse_body(request, s.max_body_bytes, schema,               # parse
                                max_messages=s.max_messages, max_parts=s.max_parts_per_message)
    check_request(req, caller.admin, state.settings.max_prompts)                 # parse: shapes we bound
    shape = structured_output(req, kind, s.structured_retries)                   # parse: response_format's schema
    ticket = await state.governor.admit(caller, req, raw, started)               # admit
    guard = await state.guard.check_input(ticket)                                # guard: before any engine call
    await route(state.routes, ticket)                                            # route
    cache = await look_up(request, state, ticket, req, raw)                      # cache: a hit answers here
    if cache is not None and cache.answer is not None:
        return await answer_from_cache(state, kind, cache, ticket, req, guard, shape)  # ... settled at no cost
    response = await generate_checked(state, kind, ticket, req, shape, guard,    # generate → check → settle
                                      cache.tap() if cache else None, session_id=session_id)
    return with_cache(response, cache)                                           # cache: keep a whole answer
