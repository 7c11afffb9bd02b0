"""The admin HTTP API of the response cache (admin key only; see CACHE.md):

  PUT    /admin/cache/policies             set a policy: `{"model": M, "mode": "exact"|"semantic"|"off", "key": K?,
                                           "embedding_model", "threshold", "ttl_s", "scope", "sampled"}`;
                                           `off` removes it
  DELETE /admin/cache/policies?model=M[&key=K]   remove a policy
  GET    /admin/cache/policies             every policy, with the version in Redis and the one this replica applies
  GET    /admin/cache/stats                lookups by model, mode and result (every replica), stores, entries
  POST   /admin/cache/flush                `{"model": M}`: delete its stored answers (every mode and scope)

Each change is written to the registry's audit trail first (cache.set, cache.unset, cache.flush;
target cache:<model>, or cache:<model>/key:<id> for a key's own policy), then to Redis, where every
replica picks it up within EXAMLOPS_CACHE_REFRESH_S. A refused change changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from ..cache import CachePolicyError, CacheStore, parse_policy, space_prefix
from ..governance import MODEL_RE, KeyStore
from ._admin import json_response
from ._audit import audit
from ._body import parse_body, read_body
from ._deps import StateDep, require_admin
from ._errors import OpenAIError, error_responses
from ._generate import task_of_block

router = APIRouter(prefix="/admin/cache", tags=["admin"], dependencies=[Depends(require_admin)],
                   responses=error_responses(400, 401, 403, 404, 503))
_BODY_LIMIT = 64 * 1024


class Flush(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="The endpoint whose stored answers are deleted.")


def _target(model: str, key_id: str) -> str:
    return f"cache:{model}/key:{key_id}" if key_id else f"cache:{model}"


def _endpoint(state: StateDep, model: str, param: str, task: str) -> None:
    """404 unless `model` names a registered endpoint, 400 when it serves another task."""
    if not MODEL_RE.match(model):
        raise OpenAIError(400, f"{param}: invalid model name {model!r}", code="invalid_value", param=param)
    ep = state.routes.get(model)
    if ep is None:
        raise OpenAIError(404, f"{param}: no endpoint named {model!r} is registered (`exa serve llm list`)",
                          code="model_not_found", param=param)
    if (found := task_of_block(ep.engine_block_json)) != task:
        raise OpenAIError(400, f"{param}: {model!r} is a route of task {found}, not {task} (its engine block's "
                               "task)", code="model_task_mismatch", param=param)


async def _key(state: StateDep, key_id: str) -> None:
    if key_id and await KeyStore(state.redis).get(key_id) is None:
        raise OpenAIError(404, f"key: no key {key_id!r} (`exa gateway key list`)", code="key_not_found", param="key")


async def _unset(request: Request, state: StateDep, model: str, key_id: str) -> Response:
    store = CacheStore(state.redis)
    before = await store.get(model, key_id)
    if before is not None:
        await audit(state, request, "cache.unset", _target(model, key_id), before.as_json(), None)
        await store.delete(model, key_id)
    return json_response({"model": model, "key": key_id, "removed": before is not None})


@router.put("/policies")
async def set_policy(request: Request, state: StateDep) -> Response:
    try:
        obj = orjson.loads(await read_body(request, _BODY_LIMIT))
    except orjson.JSONDecodeError:
        raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), str):
        raise OpenAIError(400, "a JSON object naming the endpoint in `model`", code="invalid_value", param="model")
    model, key_id = obj.pop("model"), obj.pop("key", None) or ""
    if not isinstance(key_id, str):
        raise OpenAIError(400, "key: a key id", code="invalid_value", param="key")
    if obj.get("mode") == "off":
        return await _unset(request, state, model, key_id)
    try:
        policy = parse_policy(model, obj, key_id)
    except CachePolicyError as exc:
        raise OpenAIError(400, str(exc), code="invalid_value", param=exc.field) from None
    _endpoint(state, model, "model", "generate")
    if policy.mode == "semantic":
        _endpoint(state, policy.embedding_model, "embedding_model", "embed")
    await _key(state, key_id)
    store = CacheStore(state.redis)
    before = await store.get(model, key_id)
    await audit(state, request, "cache.set", _target(model, key_id), before.as_json() if before else None,
                policy.as_json())
    await store.put(policy)
    return json_response(policy.as_json())


@router.delete("/policies")
async def unset_policy(request: Request, state: StateDep, model: str, key: str = "") -> Response:
    return await _unset(request, state, model, key)


@router.get("/policies")
async def list_policies(state: StateDep) -> Response:
    store = CacheStore(state.redis)
    rows = [p.as_json() for _, p in sorted((await store.all()).items())]
    # version: the policies' in Redis; applied: this replica's copy of them (equal once it has refreshed)
    return json_response({"object": "list", "version": await store.version(), "applied": state.cache.book.version,
                          "data": rows})


@router.get("/stats")
async def stats(state: StateDep) -> Response:
    """Lookups, hits and stores by model and mode, summed over every replica (each adds its tallies
    every EXAMLOPS_CACHE_REFRESH_S), and the answers stored now."""
    store = CacheStore(state.redis)
    rows: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    for field, n in (await store.stats()).items():
        model, mode, result = field.split("|")
        rows[(model, mode)][result] = n
    for (model, mode), n in (await store.entries()).items():
        rows[(model, mode)]["entries"] = n
    results = ("hit-exact", "hit-semantic", "miss", "bypass", "store", "entries")
    data = [{"model": model, "mode": mode, **{r: row.get(r, 0) for r in results}}
            for (model, mode), row in sorted(rows.items())]
    return json_response({"object": "list", "data": data, "semantic_index": state.cache.index.stats()})


@router.post("/flush")
async def flush(request: Request, state: StateDep) -> Response:
    _, body = await parse_body(request, _BODY_LIMIT, Flush)
    if not MODEL_RE.match(body.model):
        raise OpenAIError(400, f"invalid model name {body.model!r}", code="invalid_value", param="model")
    await audit(state, request, "cache.flush", _target(body.model, ""), None, {"model": body.model})
    deleted = await CacheStore(state.redis).flush(body.model)
    indexed = await state.cache.index.flush(space_prefix(body.model))
    return json_response({"model": body.model, "deleted": deleted, "index_entries": indexed})
