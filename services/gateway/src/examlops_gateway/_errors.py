"""One error shape for every error: OpenAI's `{"error": {message, type, code, param}}`."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from examlops.svc import error_reason


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


def from_grpc(exc: grpc.aio.AioRpcError, endpoint: str) -> OpenAIError:
    reason, param = error_reason(exc)
    details = exc.details() or exc.code().name
    if reason == "AllBackendsFailed":
        return OpenAIError(502, details, type="AllBackendsFailed", code="all_backends_failed")
    if not reason and exc.code() == grpc.StatusCode.UNAVAILABLE:
        return OpenAIError(503, f"engine-proxy unavailable while serving endpoint:{endpoint}: {details}",
                           type="service_unavailable", code="engine_proxy_unavailable")
    status, typ = _GRPC_TO_HTTP.get(exc.code(), (500, "internal_error"))
    return OpenAIError(status, details, type=typ, code=reason or exc.code().name.lower(), param=param or None)


def install_error_handlers(app: FastAPI) -> None:
    async def openai_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return from_validation(exc).response()

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return OpenAIError(exc.status_code, str(exc.detail), code=code).response()

    async def unexpected(_: Request, exc: Exception) -> Response:
        return OpenAIError(500, f"internal error: {type(exc).__name__}", type="internal_error",
                           code="internal_error").response()

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
