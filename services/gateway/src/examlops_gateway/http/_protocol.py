"""Request models: validate what the gateway relies on, pass everything else through untouched."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # Parts are judged by mediaguard (engine-proxy calls it), which names the offending part.
    content: str | list[Any] | None = None


class GenerationRequest(BaseModel):
    """What every generation request has (chat and completions)."""

    # strict: "stream": "yes" is an error, not True (OpenAI refuses it too)
    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, le=16)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
