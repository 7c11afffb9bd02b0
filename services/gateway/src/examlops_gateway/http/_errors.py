"""One error shape for every error: OpenAI's `{"error": {message, type, code, param}}`.

`OpenAIError` is what handlers raise; `ErrorResponse` is the same shape as a model, for the OpenAPI
document (`error_responses`). Governance's typed refusals are mapped to it in _denials.py.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import Response

from examlops.svc import error_reason


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, for a person.")
    type: str = Field(description="The error's class, as OpenAI names them (invalid_request_error, ...).")
    code: str | None = Field(description="Machine-readable reason (invalid_api_key, budget_exceeded, ...).")
    param: str | None = Field(description="The request field at fault, if one is.")


class ErrorResponse(BaseModel):
    """Every error the gateway answers, whatever its status."""

    error: ErrorDetail


_STATUS_MEANING = {
    400: "Invalid request body or parameter", 401: "Missing, unknown, revoked or expired API key",
    403: "The key may not do this (model not allowed or not priced, admin key required)",
    404: "Unknown model, endpoint not routed, or unknown record", 413: "Request body too large",
    429: "Budget exceeded or rate limit reached", 502: "Every backend of the endpoint failed",
    503: "A dependency (engine-proxy, Redis, registry) is unavailable",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A router's `responses=`: each status with the error shape, so /openapi.json describes it."""
    return {s: {"model": ErrorResponse, "description": _STATUS_MEANING[s]} for s in statuses}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def from_validation(exc: ValidationError | RequestValidationError) -> OpenAIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    missing = first.get("type") == "missing"
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return OpenAIError(400, message, code="missing_required_parameter" if missing else "invalid_value", param=param)


_GRPC_TO_HTTP = {
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>)]+|\[[0-9a-f:]+\](?::\d+)?|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b",
                      re.IGNORECASE)


def without_addresses(text: str) -> str:
    """`text` with URLs and IP addresses (and their ports) replaced by `<internal address>`."""
    return _ADDRESS.sub("<internal address>", text)


def from_grpc(exc: grpc.aio.AioRpcError, endpoint: str, *, admin: bool) -> OpenAIError:
    """An engine-proxy error as the caller gets it. Only the admin key sees why a backend or
    engine-proxy failed: the details name internal addresses (http://10.…:8000, ipv4:…); any other
    caller gets `endpoint:<model>` and, for a refusal by the engine, its message without addresses."""
    reason, param = error_reason(exc)
    details = exc.details() or exc.code().name
    if reason == "AllBackendsFailed":
        message = details if admin else f"all backends failed for endpoint:{endpoint} (the admin key sees why)"
        return OpenAIError(502, message, type="AllBackendsFailed", code="all_backends_failed")
    if not reason and exc.code() == grpc.StatusCode.UNAVAILABLE:
        return OpenAIError(503, f"engine-proxy unavailable while serving endpoint:{endpoint}"
                                + (f": {details}" if admin else ""),
                           type="service_unavailable", code="engine_proxy_unavailable")
    status, typ = _GRPC_TO_HTTP.get(exc.code(), (500, "internal_error"))
    return OpenAIError(status, details if admin else without_addresses(details), type=typ,
                       code=reason or exc.code().name.lower(), param=param or None)
