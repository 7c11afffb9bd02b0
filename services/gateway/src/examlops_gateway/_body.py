"""Reading a request body with a hard size limit, before any parsing."""

from __future__ import annotations

from starlette.requests import Request

from ._errors import OpenAIError


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


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes "
                            "(EXAMLOPS_MAX_BODY_BYTES)", code="request_too_large")
