"""Reading a request body with a hard size limit, and parsing it with one model, before anything else.

The body is read raw and parsed by us (`model_validate_json`, no intermediate dict), never by
FastAPI: the raw bytes are what engine-proxy receives and what the prompt bound is measured on.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ._errors import OpenAIError, from_validation

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, limit: int, model: type[M]) -> tuple[bytes, M]:
    """The raw body and its parsed model; 413 above `limit`, 400 for bad JSON or a bad field."""
    raw = await read_body(request, limit)
    try:
        return raw, model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0].get("type") == "json_invalid":
            raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
        raise from_validation(exc) from None


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes "
                            "(EXAMLOPS_MAX_BODY_BYTES)", code="request_too_large")
