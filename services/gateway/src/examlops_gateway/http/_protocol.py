"""Request models: validate what the gateway relies on, pass everything else through untouched.

Each API says which output bound its engine obeys (`output_limit`), because vLLM 0.32 reads a
different field per API (openai/{chat_completion,completion}/protocol.py and their serving.py):
chat takes `max_completion_tokens` when it is set and `max_tokens` otherwise; completions has no
`max_completion_tokens` (an unknown field, ignored) and takes `max_tokens`, 16 when absent or null.
Governance reserves from that bound and writes it into the body when it lowers or supplies it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from examlops.mediaparts import MEDIA_PART_TYPES, TEXT_PART_TYPES

from ._errors import OpenAIError
from ._fields import CHAT_FIELDS, COMPLETION_FIELDS

#: Every content part type vLLM 0.32 parses; another type is refused before any reservation.
KNOWN_PART_TYPES: Final = TEXT_PART_TYPES | MEDIA_PART_TYPES

#: The largest output bound accepted (a 32-bit int, what engines' samplers hold); larger is a 400.
MAX_TOKENS_LIMIT: Final = 2**31 - 1
#: vLLM's `max_tokens` for a completion that sets none (CompletionRequest.max_tokens = 16).
COMPLETION_DEFAULT_MAX_TOKENS: Final = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # Part types are checked at parse (ChatCompletionRequest.check_shape); media parts are judged by
    # mediaguard (engine-proxy calls it), which names the offending part.
    content: str | list[Any] | None = None


class OpenAIRequest(BaseModel):
    """What every request to a model has: its name, and the undeclared fields it may forward."""

    # strict: "stream": "yes" is an error, not True (OpenAI refuses it too)
    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(min_length=1)
    #: undeclared fields forwarded to the engine for a virtual key (_fields.py)
    forwarded: ClassVar[frozenset[str]] = frozenset()

    def check_shape(self, max_inputs: int) -> None:
        """Raise a 400 for a shape the gateway cannot bound (see check_request)."""


class GenerationRequest(OpenAIRequest):
    """What every generation request has (chat and completions)."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    n: int | None = Field(default=None, ge=1, le=16)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)

    @property
    def output_limit(self) -> int:
        """The per-choice output bound the engine obeys as the body stands (0: the engine's own)."""
        return self.max_tokens or 0

    @property
    def output_limit_sent(self) -> bool:
        """Whether the body names that bound in the field the engine reads."""
        return self.max_tokens is not None

    @property
    def choices(self) -> int:
        """How many sequences the engine generates, each up to `output_limit` tokens."""
        return self.n or 1


class ChatCompletionRequest(GenerationRequest):
    forwarded = CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)

    @property
    def output_limit(self) -> int:
        if self.max_completion_tokens is not None:  # wins over max_tokens, as in vLLM
            return self.max_completion_tokens
        return self.max_tokens or 0

    @property
    def output_limit_sent(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def check_shape(self, max_inputs: int) -> None:
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if isinstance(kind, str) and kind not in KNOWN_PART_TYPES:
                        # mediaguard's code for the same refusal, so a client meets one vocabulary
                        raise OpenAIError(400, f"unknown content part type {kind[:40]!r}: the engine "
                                               f"accepts {', '.join(sorted(KNOWN_PART_TYPES))}",
                                          code="media_type_not_allowed", param=f"messages[{i}].content[{j}]")


class CompletionRequest(GenerationRequest):
    forwarded = COMPLETION_FIELDS
    prompt: str | list[str] | list[int] | list[list[int]]

    @property
    def output_limit(self) -> int:
        return self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS

    @property
    def prompt_count(self) -> int:
        return input_count(self.prompt)

    @property
    def choices(self) -> int:
        return self.prompt_count * (self.n or 1)  # vLLM runs n sequences for every prompt

    def check_shape(self, max_inputs: int) -> None:
        count = self.prompt_count
        if not 1 <= count <= max_inputs:
            raise OpenAIError(400, f"prompt: a list of 1 to {max_inputs} prompts is accepted, not {count} "
                                   "(EXAMLOPS_MAX_PROMPTS)", code="invalid_value", param="prompt")


def input_count(value: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many inputs a completion's `prompt` or an embedding's `input` holds: a string or one list
    of token ids is one; a list of either is one each."""
    return 1 if isinstance(value, str) or (value and isinstance(value[0], int)) else len(value)


def check_request(req: OpenAIRequest, admin: bool, max_inputs: int) -> None:
    """The parse stage's refusals, for every key and before any reservation: a shape the gateway
    cannot bound (more prompts or inputs than `max_inputs`, a content part of a type the engine does
    not know); for a virtual key, a field the gateway does not forward (the admin key's requests pass
    whole)."""
    extra = req.model_extra
    if extra and not admin:
        for name in extra:
            if name not in req.forwarded:
                raise OpenAIError(400, f"{name[:60]}: this field is not forwarded to the engine for virtual keys "
                                       "(services/gateway/GOVERNANCE.md lists the fields that are)",
                                  code="unsupported_field", param=name[:60])
    req.check_shape(max_inputs)
