"""Echo engine: deterministic, dependency-free, streams and reports usage (dev and CI).

It also answers embeddings calls, with deterministic vectors (see _echo_embed).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ._base import Generation
from ._echo_embed import echo_embeddings


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _words(text: str) -> list[str]:
    return text.split()


#: a test-only request field: stream the answer in pieces of this many characters instead of word by
#: word (a match split across chunks, for the output guardrail's tests)
PIECE_FIELD = "echo_piece_chars"


def _pieces(words: list[str], piece_chars: object) -> list[str]:
    if isinstance(piece_chars, int) and not isinstance(piece_chars, bool) and piece_chars > 0:
        text = " ".join(words)
        return [text[i:i + piece_chars] for i in range(0, len(text), piece_chars)]
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


class EchoEngine:
    """Answers `echo: <last user text>`, one word per token, truncated to max_tokens."""

    name = "echo"

    def __init__(self, model: str) -> None:
        self.model = model

    def _answer(self, gen: Generation) -> tuple[list[str], int, bool]:
        body = gen.body
        if gen.kind == pb.REQUEST_KIND_CHAT:
            messages = body.get("messages") or []
            prompt_words = sum(len(_words(_text_of(m.get("content")))) for m in messages if isinstance(m, dict))
            last_user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), {})
            text = _text_of(last_user.get("content"))
        else:
            prompt = body.get("prompt", "")
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
            prompt_words = len(_words(text))
        words = ["echo:", *_words(text)]
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        truncated = isinstance(limit, int) and 0 < limit < len(words)
        return (words[:limit] if truncated else words), prompt_words, truncated

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        if gen.kind == pb.REQUEST_KIND_EMBEDDINGS:
            answer, tokens = echo_embeddings(gen.body, self.model)
            yield pb.GenerateChunk(data=orjson.dumps(answer), final=True,
                                   usage=pb.Usage(prompt_tokens=tokens, completion_tokens=0))
            return
        words, prompt_tokens, truncated = self._answer(gen)
        rid = f"echo-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                 "total_tokens": prompt_tokens + len(words)}
        usage_pb = pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(words))
        chat = gen.kind == pb.REQUEST_KIND_CHAT
        finish = "length" if truncated else "stop"
        if not gen.stream:
            text = " ".join(words)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                 "logprobs": None}
                if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
            obj = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": self.model, "choices": [choice], "usage": usage}
            yield pb.GenerateChunk(data=orjson.dumps(obj), final=True, usage=usage_pb)
            return
        kind = "chat.completion.chunk" if chat else "text_completion"
        pieces = _pieces(words, gen.body.get(PIECE_FIELD))
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            if chat:
                delta: dict[str, Any] = {"content": piece}
                if i == 0:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": finish if last else None, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish if last else None, "logprobs": None}
            obj = {"id": rid, "object": kind, "created": created, "model": self.model, "choices": [choice]}
            made = min(i + 1, len(words))
            so_far = {"prompt_tokens": prompt_tokens, "completion_tokens": made, "total_tokens": prompt_tokens + made}
            if gen.want_usage_stats:
                obj["usage"] = so_far
            yield pb.GenerateChunk(data=orjson.dumps(obj), usage=pb.Usage(prompt_tokens=prompt_tokens,
                                                                          completion_tokens=made))
        tail = b""
        if gen.want_usage_chunk:
            tail = orjson.dumps({"id": rid, "object": kind, "created": created, "model": self.model,
                                 "choices": [], "usage": usage})
        yield pb.GenerateChunk(data=tail, final=True, usage=usage_pb)

    async def aclose(self) -> None:
        return None
