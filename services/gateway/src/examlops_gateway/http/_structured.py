"""Structured output on the HTTP path (services/gateway/STRUCTURED.md): the schema refused at parse
(400), whole answers checked and retried through a new admission each (502 when none is valid),
streams checked at their end (an SSE error event instead of the held final chunk), and the verdict
header on every response to a request with a structured response_format.
"""

from __future__ import annotations

import time

import orjson
from starlette.responses import Response

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._state import GatewayState
from ..cache import StreamTap
from ..governance import Denied, Ticket
from ..guardrails import Guard
from ..structured import VERDICT_HEADER, SchemaRefused, StreamCheck, StructuredOutput
from ._errors import OpenAIError
from ._generate import _SettledAnswer, generate, route
from ._protocol import GenerationRequest

#: a cost record's status for an attempt whose answer did not meet the contract (charged in full)
STATUS_INVALID = "structured_invalid"


def structured_output(req: GenerationRequest, kind: int, retries: int) -> StructuredOutput | None:
    """The parse stage's contract: None without a structured response_format; a 400 naming the field
    when its schema is not valid JSON Schema (before anything is reserved)."""
    try:
        return StructuredOutput.of((req.model_extra or {}).get("response_format"),
                                   chat=kind == pb.REQUEST_KIND_CHAT, retries=retries)
    except SchemaRefused as exc:
        raise OpenAIError(400, exc.message, code="invalid_value", param=exc.param) from None


def invalid_answer(failure: str, attempts: int, why_no_retry: str = "") -> OpenAIError:
    return OpenAIError(502, f"the answer does not match response_format ({attempts} attempt"
                            f"{'s' if attempts > 1 else ''}{why_no_retry}): {failure}",
                       type="invalid_response_error", code="structured_output_invalid", param="response_format",
                       headers={VERDICT_HEADER: "invalid"})


class CheckedStream:
    """A stream's hook: holds what must wait for the verdict, and gives the verdict at the end."""

    __slots__ = ("check", "held")

    def __init__(self, check: StreamCheck) -> None:
        self.check, self.held = check, bytearray()

    def holds(self, data: bytes) -> bool:
        if self.check.hold(data):
            self.held += b"data: " + data + b"\n\n"
            return True
        return False

    def end(self, status: str) -> tuple[bytes, str, bytes]:
        """(events to release now, the call's status, an error event): the held chunks when the
        answer is valid; otherwise none of them, and the error event."""
        failure = self.check.failure()
        if failure is None:
            return bytes(self.held), status, b""
        error = invalid_answer(failure, 1, ", a stream is not retried").body()
        return b"", STATUS_INVALID, b"data: " + orjson.dumps(error) + b"\n\n"


async def generate_checked(state: GatewayState, kind: int, ticket: Ticket, req: GenerationRequest,
                           shape: StructuredOutput | None, guard: Guard | None = None,
                           tap: StreamTap | None = None, session_id: str = "") -> Response:
    """generate, and with a contract, its check. An invalid whole answer settles its own attempt
    (STATUS_INVALID) and is tried again on the same route, with the body the engine got, through a
    new admission (budgets and rate limits hold for every attempt), up to `shape.retries` times."""
    if shape is None:
        return await generate(state, kind, ticket, guard=guard, tap=tap, session_id=session_id, req=req)
    if ticket.stream:
        stream = await generate(state, kind, ticket, CheckedStream(shape.stream_check()), guard=guard, tap=tap,
                                session_id=session_id, req=req)
        stream.headers[VERDICT_HEADER] = "deferred"  # the verdict is the stream's last event
        return stream
    attempt, why_no_retry = 0, ""
    while True:
        answer = await generate(state, kind, ticket, guard=guard, session_id=session_id, req=req)
        assert isinstance(answer, _SettledAnswer)
        failure = shape.check_answer(bytes(answer.body))
        if failure is None:
            answer.headers[VERDICT_HEADER] = "retried" if attempt else "valid"
            return answer
        answer.span.failed("structured_output_invalid", failure)
        await answer.span.settle(ticket, STATUS_INVALID, answer.usage, None)
        attempt += 1
        if attempt > shape.retries:
            break
        try:
            ticket = await state.governor.admit(ticket.caller, req, ticket.body, time.perf_counter())
        except Denied as exc:
            why_no_retry = f", no retry: {exc.code}"
            break
        await route(state.routes, ticket)
    raise invalid_answer(failure, attempt, why_no_retry)
