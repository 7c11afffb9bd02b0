"""POST /v1/embeddings: its request model and its request path, the generation's stages minus
those that read an answer's text (guardrails, structured output, streaming).

An embedding is admitted like a generation with no output: the prompt bound (its body's bytes, as
for chat) at the input price, zero output tokens, so a budget or TPM limit reserves the input only
and the body reaches the engine unchanged. engine-proxy answers with one final chunk, the engine's
OpenAI embeddings JSON, passed back byte for byte and settled with the engine's prompt tokens.
"""

from __future__ import annotations

import time
from typing import Literal, cast

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._state import GatewayState
from ..governance import Caller
from ._body import parse_body
from ._errors import OpenAIError
from ._fields import EMBEDDING_FIELDS
from ._generate import generate, route
from ._protocol import MAX_TOKENS_LIMIT, OpenAIRequest, check_request, input_count

#: the largest token id accepted in a token-array input (a 32-bit int, what engines' vocabularies hold)
MAX_TOKEN_ID = MAX_TOKENS_LIMIT


class EmbeddingRequest(OpenAIRequest):
    """OpenAI's embeddings request. Each input is bounded by the body limit (EXAMLOPS_MAX_BODY_BYTES)
    and their number by EXAMLOPS_MAX_EMBEDDING_INPUTS; none may be empty."""

    forwarded = EMBEDDING_FIELDS
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    user: str | None = None

    # what admission reads (governance.Generation): a call that generates nothing
    @property
    def stream(self) -> bool:
        return False

    @property
    def choices(self) -> int:
        return 0  # no output tokens: nothing reserved or charged at the output price

    @property
    def output_limit(self) -> int:
        return 0

    @property
    def output_limit_sent(self) -> bool:
        return False

    def check_shape(self, max_inputs: int) -> None:
        value = self.input
        count = input_count(value)
        if not 1 <= count <= max_inputs:
            raise OpenAIError(400, f"input: a list of 1 to {max_inputs} inputs is accepted, not {count} "
                                   "(EXAMLOPS_MAX_EMBEDDING_INPUTS)", code="invalid_value", param="input")
        for param, one in _inputs(value):
            if not one:
                raise OpenAIError(400, f"{param}: an input may not be empty", code="invalid_value", param=param)
            if not isinstance(one, str) and not 0 <= min(one) <= max(one) <= MAX_TOKEN_ID:
                raise OpenAIError(400, f"{param}: token ids are integers from 0 to {MAX_TOKEN_ID}",
                                  code="invalid_value", param=param)


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[tuple[str, str | list[int]]]:
    """Each input with the name a client knows it by (`input`, or `input[i]` in a list of them)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [("input", value)]
    return [(f"input[{i}]", one) for i, one in enumerate(cast("list[str | list[int]]", value))]


async def serve_embeddings(request: Request, state: GatewayState, caller: Caller) -> Response:
    """The request path of an embedding, its stages in hot-path order (as _pipeline.serve_generation)."""
    started = time.perf_counter()
    await state.key_check.check(caller)                                          # auth: before the body
    s = state.settings
    raw, req = await parse_body(request, s.max_body_bytes, EmbeddingRequest)     # parse
    check_request(req, caller.admin, s.max_embedding_inputs)                     # parse: shapes we bound
    ticket = await state.governor.admit(caller, req, raw, started)               # admit: input price only
    await route(state.routes, ticket, task="embed")                              # route: an embed route
    return await generate(state, pb.REQUEST_KIND_EMBEDDINGS, ticket, req=req)    # generate → settle
