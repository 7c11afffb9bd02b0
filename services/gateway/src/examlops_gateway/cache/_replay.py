"""Cached answers in and out: a whole chat.completion is what is stored; a hit is answered in the
client's mode (the JSON with a fresh id, or SSE events replaying it); a streamed answer is put back
together from the chunks it sent, after the stream has ended.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

#: the generated-text fields of a chat message that a replay carries
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


def fresh(answer: dict[str, Any]) -> dict[str, Any]:
    """The stored answer under a new id and creation time."""
    return {**answer, "id": f"chatcmpl-cache-{secrets.token_hex(12)}", "created": int(time.time())}


def sse_events(answer: dict[str, Any], include_usage: bool) -> bytes:
    """A whole answer as a stream: the role, the text, the finish reason, then (when the client asked
    with stream_options.include_usage) the original answer's usage, then [DONE]."""
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer.get("model", "")}
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{name: message[name]} for name in _TEXT_FIELDS if message.get(name)]
    events = [{**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
              for d in deltas]
    events.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": choice.get("finish_reason")}]})
    if include_usage and answer.get("usage"):
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def storable(answer: Any, client_bound: bool) -> bool:
    """Whether an answer may be kept: one chat choice of text that ended by itself, or at the
    client's own max_tokens (not at a bound governance lowered for this key's budget)."""
    if not isinstance(answer, dict) or answer.get("object") != "chat.completion":
        return False
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    message = choices[0].get("message")
    if not isinstance(message, dict) or not isinstance(message.get("content"), str) or message.get("tool_calls"):
        return False
    finish = choices[0].get("finish_reason")
    return finish == "stop" or (finish == "length" and client_bound)


def assemble(chunks: list[bytes], usage: pb.Usage | None) -> dict[str, Any] | None:
    """The chat.completion a complete stream of chat.completion.chunk events amounts to (None when it
    is not one plain answer: several choices, tool calls, an error event). `usage`: the engine's
    final count, which a stream carries whether or not the client asked for a usage chunk."""
    head: dict[str, Any] = {}
    text: dict[str, list[str]] = {name: [] for name in _TEXT_FIELDS}
    finish = None
    for data in chunks:
        obj = orjson.loads(data)
        if not isinstance(obj, dict) or "error" in obj:
            return None
        if not head:
            head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint") if k in obj}
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("index", 0) != 0 or delta.get("tool_calls") or delta.get("function_call"):
                return None
            for name in _TEXT_FIELDS:
                if isinstance(delta.get(name), str):
                    text[name].append(delta[name])
            finish = choice.get("finish_reason") or finish
    if not head or finish is None:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text["content"])}
    message.update({name: "".join(parts) for name, parts in text.items() if parts and name != "content"})
    answer = {**head, "object": "chat.completion",
              "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
        answer["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    return answer
