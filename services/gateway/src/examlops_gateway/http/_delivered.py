"""What a stream has sent its client so far: what a stream cut short (the client left, the engine
failed) is billed.

engine-proxy passes the engine's running usage with every chunk (vLLM's continuous usage stats), so
this is normally the engine's own count of what was delivered. For chunks that came without usage
it keeps an upper bound from the text they carried: byte-level BPE and byte-fallback vocabularies
never make more tokens than bytes (governance/_budget.py), and a chunk of a choice carries at least
one token, so the bound is the larger of the two, per choice and chunk. Never less than delivered.
"""

from __future__ import annotations

from typing import Any

import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._events import events_of

#: the fields of a chunk's choice whose strings are generated text (chat delta, completion, tools)
_TEXT_FIELDS = ("content", "text", "reasoning_content", "reasoning", "refusal", "arguments", "name")


def _text_bytes(obj: Any) -> int:
    """UTF-8 bytes of the generated text in one choice of a chunk (its delta, or a completion's text)."""
    if isinstance(obj, dict):
        size = 0
        for key, value in obj.items():
            if isinstance(value, str):
                size += len(value.encode()) if key in _TEXT_FIELDS else 0
            elif key != "logprobs":
                size += _text_bytes(value)
        return size
    if isinstance(obj, list):
        return sum(_text_bytes(v) for v in obj)
    return 0


def completion_bound(data: bytes) -> int:
    """An upper bound of the completion tokens one stream chunk delivered."""
    try:
        choices = orjson.loads(data).get("choices") or []
    except (orjson.JSONDecodeError, AttributeError):
        return len(data)  # not a chunk we can read: every byte may be a token
    return sum(max(1, _text_bytes(c)) for c in choices)


class Delivered:
    """The latest usage the engine reported, and a bound of what was sent beyond it."""

    __slots__ = ("beyond", "usage")

    def __init__(self) -> None:
        self.usage: pb.Usage | None = None
        self.beyond = 0

    def add(self, chunk: pb.GenerateChunk) -> None:
        """One message sent (its chunks are split only when it came without usage)."""
        if chunk.HasField("usage"):
            self.usage, self.beyond = chunk.usage, 0
        elif chunk.sse or chunk.data:
            self.beyond += sum(completion_bound(data) for data in events_of(chunk))
