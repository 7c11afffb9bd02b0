"""Budgets: reserve-then-settle in integer micro-USD, and the bounds a reservation is built from.

Before dispatch, reserve.lua checks `spent + reserved + max_cost <= budget` and reserves max_cost in
the same atomic step, where

    max_cost = ceil((prompt_bound * input_price + choices * max_tokens * output_price) / 1e6)   micro-USD

(prices in micro-USD per million tokens). `max_tokens` is the bound the engine obeys for the
request's API (`Generation.output_limit`: chat's `max_completion_tokens` else `max_tokens`, the
completions API's `max_tokens`, 16 when absent), or EXAMLOPS_DEFAULT_MAX_TOKENS when the request
leaves it to the engine, lowered to what the remaining budget pays for; the gateway writes that
number into the body whenever it differs from, or is missing in, what the engine would read, so
the engine cannot produce more than was reserved.
After the answer, settle.lua replaces the reservation by the real cost, from the engine's usage.
An embedding has no output (`choices` 0): it reserves and is charged its prompt at the input price
only, and its body is never rewritten.

The prompt bound needs no tokenizer: the request body's length in bytes, minus the bytes of media
parts (the types vLLM 0.32 parses as media, examlops.mediaparts.MEDIA_PART_TYPES; every part it renders
as text, input_text, output_text, refusal and thinking included, counts by its bytes; unknown types
are refused at parse), plus EXAMLOPS_MEDIA_PART_TOKENS per media part and EXAMLOPS_PROMPT_OVERHEAD_TOKENS for the
chat template. Byte-level BPE and byte-fallback SentencePiece vocabularies (GPT, Llama, Qwen,
Mistral, SmolLM) never make more tokens than bytes, and JSON only adds bytes around the text, so
for text this is an upper bound (typically 3-4x the real count; the settle charges the real one).

Overshoot bound. Spend can pass the budget only by the amount a call's real cost exceeds its
reservation, which needs the bound above to fail (a media part larger than EXAMLOPS_MEDIA_PART_TOKENS,
a chat template longer than the overhead) or a reservation reaped while its gateway was alive but
silent for EXAMLOPS_REPLICA_TTL_S. With text prompts and live replicas the overshoot is zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from examlops.mediaparts import MEDIA_PART_TYPES


class Message(Protocol):
    @property
    def content(self) -> Any: ...


class Generation(Protocol):
    """What admission reads of a parsed request (the HTTP layer's protocol models)."""

    @property
    def model(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def choices(self) -> int: ...   # 0: the call generates nothing (an embedding)
    @property
    def output_limit(self) -> int: ...
    @property
    def output_limit_sent(self) -> bool: ...


def estimate_prompt_tokens(raw: bytes, messages: Sequence[Message] | None, overhead: int, media_tokens: int) -> int:
    """An upper bound of the prompt's tokens (see the module docstring). Only parts of a media type
    count flat; every other part (text, input_text, refusal, thinking, ...) counts by its bytes."""
    size = len(raw)
    media = 0
    for m in messages or ():
        content = m.content
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                    size -= len(orjson.dumps(part))
                    media += 1
    return max(size, 0) + media * media_tokens + overhead


def with_max_tokens(raw: bytes, max_tokens: int) -> bytes:
    """The body with the output bound the gateway reserved for, in every field an engine may read it
    from (`max_tokens`; `max_completion_tokens` too when the client set it, as vLLM's chat prefers it)."""
    body = orjson.loads(raw)
    body["max_tokens"] = max_tokens
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = max_tokens
    return orjson.dumps(body)
