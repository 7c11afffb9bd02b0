"""The OpenAI-compatible surface: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

A generation runs `serve_generation` (_pipeline.py), an embedding `serve_embeddings`
(_embeddings.py); the body is read raw and parsed by us, so its OpenAPI description is given with
`openapi_extra` (see _openapi.py).
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ._deps import CallerDep, StateDep
from ._embeddings import EmbeddingRequest, serve_embeddings
from ._errors import error_responses
from ._generate import task_of_block
from ._openapi import parsed_body
from ._pipeline import serve_generation
from ._protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["openai"], responses=error_responses(401, 503))
_GENERATION_ERRORS = error_responses(400, 403, 404, 413, 429, 502)


@router.post("/v1/chat/completions", responses=_GENERATION_ERRORS, openapi_extra=parsed_body(ChatCompletionRequest))
async def chat_completions(request: Request, state: StateDep, caller: CallerDep) -> Response:
    return await serve_generation(request, state, caller, pb.REQUEST_KIND_CHAT, ChatCompletionRequest)


@router.post("/v1/completions", responses=_GENERATION_ERRORS, openapi_extra=parsed_body(CompletionRequest))
async def completions(request: Request, state: StateDep, caller: CallerDep) -> Response:
    return await serve_generation(request, state, caller, pb.REQUEST_KIND_COMPLETION, CompletionRequest)


@router.post("/v1/embeddings", responses=_GENERATION_ERRORS, openapi_extra=parsed_body(EmbeddingRequest))
async def embeddings(request: Request, state: StateDep, caller: CallerDep) -> Response:
    return await serve_embeddings(request, state, caller)


@router.get("/v1/models")
async def list_models(state: StateDep, caller: CallerDep) -> Response:
    """The routable endpoints; for a virtual key, only those it may use (once the key checks out).
    `task` says which API a model answers: `generate` (chat, completions) or `embed` (embeddings)."""
    allowed = await state.governor.allowed_models(caller)
    data = [{"id": ep.name, "object": "model", "created": ep.created_at_ms // 1000,
             "owned_by": ep.project or "examlops", "task": task_of_block(ep.engine_block_json)}
            for ep in sorted(state.routes.routable(), key=lambda e: e.name)
            if allowed is None or ep.name in allowed]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
