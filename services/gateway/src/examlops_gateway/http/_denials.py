"""Governance's refusals as a client gets them (the table in GOVERNANCE.md), and the handlers that
turn every exception into the one error shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..governance import MICRO, Denied, GovernanceUnavailable
from ..guardrails import HEADER, GuardrailBlocked, PolicyError
from ._errors import OpenAIError, from_validation

_NO_RETRY = {"x-should-retry": "false"}
_KEY_CODES = ("invalid_api_key", "key_revoked", "key_expired")


def from_denial(d: Denied) -> OpenAIError:
    key_id, model = d.key_id, d.model
    if d.code in _KEY_CODES:
        message = {"invalid_api_key": "incorrect API key provided",
                   "key_revoked": f"key {key_id} has been revoked",
                   "key_expired": f"key {key_id} has expired"}[d.code]
        return OpenAIError(401, message, code=d.code, headers={"WWW-Authenticate": "Bearer", **_NO_RETRY})
    if d.code == "model_not_allowed":
        allowed = ", ".join(d.allowed) or "none"
        return OpenAIError(403, f"key {key_id} may not use model '{model}' (allowed: {allowed})",
                           type="permission_error", code="model_not_allowed", param="model", headers=_NO_RETRY)
    if d.code == "model_not_priced":
        return OpenAIError(403, f"model '{model}' has no price, and key {key_id} has a budget: set one with "
                                f"`exa gateway price set {model} --input-per-mtok USD --output-per-mtok USD`",
                           type="permission_error", code="model_not_priced", param="model", headers=_NO_RETRY)
    if d.code == "budget_exceeded":
        return OpenAIError(429, f"budget of key {key_id} exceeded: {d.left_micro / MICRO:.6f} USD left, less than "
                                "this request's prompt and one output token cost",
                           type="insufficient_quota", code="budget_exceeded", headers=_NO_RETRY)
    if d.code == "tpm_too_small":
        return OpenAIError(429, f"the prompt alone is larger than the tokens-per-minute limit ({d.detail}) of "
                                f"key {key_id}: shorten it, or raise the key's --tpm",
                           type="rate_limit_error", code="rate_limit_exceeded", headers=_NO_RETRY)
    what = "requests" if d.code == "rpm_exceeded" else "tokens"
    return OpenAIError(429, f"{what}-per-minute limit of key {key_id} reached; retry in {d.retry_after_s} s",
                       type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(d.retry_after_s)})


def from_block(b: GuardrailBlocked) -> OpenAIError:
    """A guardrail's block: 400 guardrail_blocked naming policy, detector and entity (never the text);
    `param` names the prompt's message or part on input."""
    return OpenAIError(400, str(b), code="guardrail_blocked", param=b.param if b.direction == "input" else None,
                       headers={**_NO_RETRY, HEADER: f"{b.policy}/{b.detector}/{b.entity}/block=1"})


def governance_unavailable(exc: GovernanceUnavailable) -> OpenAIError:
    return OpenAIError(503, f"the governance store (Redis) is unavailable: {exc.cause_name}",
                       type="service_unavailable", code="governance_unavailable")


def _http_error(exc: StarletteHTTPException) -> OpenAIError:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return OpenAIError(exc.status_code, str(exc.detail), code=code)


def _unexpected(exc: Exception) -> OpenAIError:
    return OpenAIError(500, f"internal error: {type(exc).__name__}", type="internal_error", code="internal_error")


#: every exception a handler may raise, as the client gets it (the most specific class first is
#: found by walking the exception's MRO, as Starlette does); Exception is the 500
_AS_ERROR: dict[type[Exception], Callable[[Any], OpenAIError]] = {
    OpenAIError: lambda exc: exc,
    Denied: from_denial,
    GovernanceUnavailable: governance_unavailable,
    GuardrailBlocked: from_block,
    PolicyError: lambda exc: OpenAIError(400, str(exc), code="invalid_value", param=exc.field),
    RequestValidationError: from_validation,
    StarletteHTTPException: _http_error,
    Exception: _unexpected,
}
#: the exceptions answered as the client's error, not an internal one
HANDLED = tuple(cls for cls in _AS_ERROR if cls is not Exception)


def error_response(exc: Exception) -> Response:
    """The response the client gets for `exc` (what install_error_handlers answers)."""
    for cls in type(exc).__mro__:
        if (convert := _AS_ERROR.get(cls)) is not None:
            return convert(exc).response()
    return _unexpected(exc).response()


async def _handler(_: Request, exc: Exception) -> Response:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    for cls in _AS_ERROR:
        app.add_exception_handler(cls, _handler)
