"""Reading a request body with a hard size limit, and parsing it with one model, before anything else.

The body is read raw and parsed by us (`model_validate_json`, no intermediate dict), never by
FastAPI: the raw bytes are what engine-proxy receives and what the prompt bound is measured on.
It is read only once the caller's key has checked out (the pipeline's auth stage). A body over
INLINE_PARSE_BYTES is parsed in a worker thread, off the event loop; small ones inline, which is
faster. A chat body holds at most `max_messages` messages of at most `max_parts` content parts
each; the messages are counted before the parse (see _too_many_messages).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ._errors import OpenAIError, from_validation

M = TypeVar("M", bound=BaseModel)

INLINE_PARSE_BYTES = 256 * 1024


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


async def parse_body(request: Request, limit: int, model: type[M], *, max_messages: int = 0,
                     max_parts: int = 0) -> tuple[bytes, M]:
    """The raw body and its parsed model; 413 above `limit`, 400 for bad JSON, a bad field, or more
    messages or parts than allowed (0: no bound)."""
    raw = await read_body(request, limit)
    if max_messages and (roles := raw.count(b'"role"')) > max_messages:  # before the parse: _too_many_messages
        raise _too_many_messages(str(roles), max_messages)
    if len(raw) > INLINE_PARSE_BYTES:
        return raw, await asyncio.to_thread(_parse, raw, model, max_messages, max_parts)
    return raw, _parse(raw, model, max_messages, max_parts)


def _parse(raw: bytes, model: type[M], max_messages: int, max_parts: int) -> M:
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0].get("type") == "json_invalid":
            raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
        raise from_validation(exc) from None
    messages = getattr(parsed, "messages", None)
    if max_messages and messages is not None:
        _bound_messages(messages, max_messages, max_parts)
    return parsed


def _bound_messages(messages: Sequence[Any], max_messages: int, max_parts: int) -> None:
    if len(messages) > max_messages:
        raise _too_many_messages(str(len(messages)), max_messages)
    for i, m in enumerate(messages):
        if isinstance(m.content, list) and len(m.content) > max_parts:
            raise OpenAIError(400, f"messages[{i}].content: {len(m.content)} parts exceed the limit of {max_parts} "
                                   "per message (EXAMLOPS_MAX_PARTS_PER_MESSAGE)", code="too_many_parts",
                              param=f"messages[{i}].content")


def _too_many_messages(count: str, limit: int) -> OpenAIError:
    """pydantic-core holds the GIL while it parses, so a body of many small messages would hold the
    event loop for seconds even in a thread: every message has a `"role"` key, and that byte string
    cannot stand inside a JSON string (its quotes would be escaped), so counting it bounds the
    messages before the parse. A key written with escapes only skips this count, not the bound,
    which is checked again on the parsed messages."""
    return OpenAIError(400, f"messages: {count} messages exceed the limit of {limit} (EXAMLOPS_MAX_MESSAGES)",
                       code="too_many_messages", param="messages")


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes "
                            "(EXAMLOPS_MAX_BODY_BYTES)", code="request_too_large")
