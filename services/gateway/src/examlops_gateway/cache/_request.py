"""What of a request the cache looks at: whether it may be cached at all, its scope, the exact key,
and, for semantic mode, the space it is compared in and the text that is embedded.

Isolation is built into every key: the scope (the key id, the key's tenant and project, its tenant,
or `admin` for the admin key) is hashed into the exact key and into the semantic space, so entries
of two scopes are never compared, whatever their similarity.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import orjson

from examlops.mediaparts import TEXT_PART_TYPES

from ..governance import Ticket
from ._policy import CachePolicy

#: fields that do not change the answer: left out of the exact key and the semantic space
IGNORED: Final = frozenset({"stream", "stream_options", "user"})
#: fields whose presence makes an answer unfit to replay (tool calls, per-token data)
_UNCACHEABLE: Final = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs",
                       "prompt_logprobs")


def scope_of(policy: CachePolicy, ticket: Ticket) -> list[str]:
    """Who shares answers: the admin key alone, or the key, its tenant's project, its tenant."""
    if ticket.caller.admin:
        return ["admin"]
    if policy.scope == "project":
        return ["project", ticket.tenant, ticket.project]
    if policy.scope == "tenant":
        return ["tenant", ticket.tenant]
    return ["key", ticket.caller.key_id]


def _digest(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _text(content: Any) -> str | None:
    """A message's text, or None when it carries anything but text parts (media)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                return None
            texts.append(str(part.get("text") or ""))
        return "\n".join(texts)
    return "" if content is None else None


def why_not_cached(body: dict[str, Any], policy: CachePolicy) -> str | None:
    """None when the request may be cached; else why not (a bypass)."""
    if (body.get("n") or 1) > 1:
        return "n>1"
    for name in _UNCACHEABLE:
        if body.get(name) not in (None, False, [], 0):
            return name
    if not policy.sampled and body.get("temperature") != 0 and body.get("seed") is None:
        return "sampled"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages"
    if any(not isinstance(m, dict) or _text(m.get("content")) is None for m in messages):
        return "media"
    return None


def exact_key(model: str, scope: list[str], body: dict[str, Any]) -> str:
    """sha256 of the model, the scope and the request minus what does not change the answer."""
    return _digest({"model": model, "scope": scope,
                    "request": {k: v for k, v in body.items() if k not in IGNORED}})


def semantic_space(model: str, scope: list[str], route: str, body: dict[str, Any],
                   engine_body: dict[str, Any]) -> tuple[str, str] | None:
    """(space, text to embed), or None when the last message is not a user's text.

    The space holds, exactly: the scope, the conversation before the last user turn (system prompt
    included), every other request field (sampling, max_tokens, response_format, ...) and the
    embedding route. Only the last user turn is compared by meaning. `body` is the client's request,
    `engine_body` what the engine receives (the input guardrails' redactions applied), whose last
    turn is what gets embedded."""
    messages = engine_body.get("messages") or []
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    text = _text(last.get("content"))
    if not text:
        return None
    params = {k: v for k, v in body.items() if k not in IGNORED and k != "messages"}
    digest = _digest({"scope": scope, "context": messages[:-1], "params": params, "route": route})
    return f"{model}|{digest[:40]}", text


def space_prefix(model: str) -> str:
    """What every semantic space of `model` starts with (a flush)."""
    return f"{model}|"
