"""The structured-output stage: a request's contract (parse), and the check of its answers (after
generate): a whole answer's every choice, or a stream's text accumulated as it passes through.

A stream is never buffered: each chunk goes on to the client as it comes, except a choice's last
chunk (the one carrying its `finish_reason`, usually with the answer's closing text), which is held
until the whole answer has been checked. The verdict then releases it (valid) or replaces it with
an error event (invalid); no retry is possible once content has been sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from ._schema import Contract, contract_of
from ._validate import choice_failure

#: the response header naming the verdict: valid | retried | invalid, or deferred on a stream
VERDICT_HEADER = "x-examlops-structured"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request with a structured response_format is held to, and how often it is retried."""

    contract: Contract
    retries: int           # further attempts after an invalid whole answer (0-3)
    chat: bool             # chat answers carry message.content / delta.content, completions text

    @classmethod
    def of(cls, response_format: Any, *, chat: bool, retries: int) -> StructuredOutput | None:
        """None when the request sets no contract; SchemaRefused when its schema is not one."""
        contract = contract_of(response_format)
        return None if contract is None else cls(contract, retries, chat)

    def check_answer(self, data: bytes) -> str | None:
        """None when every choice of a whole answer meets the contract; else the first failure."""
        try:
            choices = orjson.loads(data).get("choices") or []
        except (orjson.JSONDecodeError, AttributeError):
            return "$: the engine's answer is not a completion"
        if not choices:
            return "$: the answer has no choices"
        for i, choice in enumerate(choices):
            text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
            failure = choice_failure(self.contract, choice.get("index", i), text, choice.get("finish_reason"),
                                     len(choices))
            if failure is not None:
                return failure
        return None

    def stream_check(self) -> StreamCheck:
        return StreamCheck(self)


@dataclass(slots=True)
class StreamCheck:
    """A stream's text per choice, accumulated as it passes; the verdict at its end."""

    shape: StructuredOutput
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, Any] = field(default_factory=dict)

    def hold(self, data: bytes) -> bool:
        """Take in one chunk; True when it waits for the verdict: it ends a choice, or it is the
        closing usage chunk (no choices), which must stay last."""
        try:
            choices = orjson.loads(data).get("choices") or []
        except (orjson.JSONDecodeError, AttributeError):
            return False  # not a chunk (the engine-proxy passes only chunks): nothing to check
        ends = not choices
        for choice in choices:
            index = choice.get("index", 0)
            piece = (choice.get("delta") or {}).get("content") if self.shape.chat else choice.get("text")
            if isinstance(piece, str):
                self.texts.setdefault(index, []).append(piece)
            if choice.get("finish_reason") is not None:
                self.finish[index] = choice["finish_reason"]
                ends = True
        return ends

    def failure(self) -> str | None:
        """None when every choice's text meets the contract; else the first failure."""
        indexes = sorted(self.texts.keys() | self.finish.keys()) or [0]
        for index in indexes:
            parts = self.texts.get(index)
            failure = choice_failure(self.shape.contract, index, "".join(parts) if parts else None,
                                     self.finish.get(index), len(indexes))
            if failure is not None:
                return failure
        return None
