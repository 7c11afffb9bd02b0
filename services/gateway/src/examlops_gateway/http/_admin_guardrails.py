"""The admin HTTP API of guardrail policies (admin key only; see GUARDRAILS.md):

  PUT    /admin/guardrails/{name}          set a policy (`{"detectors": [...]}`), replacing it
  GET    /admin/guardrails                 every policy, with the endpoints and keys it is attached to
  GET    /admin/guardrails/{name}          one policy
  DELETE /admin/guardrails/{name}          delete (refused while attached: detach it first)
  POST   /admin/guardrails/{name}/attach   `{"model": M}`: applies to every call of that endpoint
  POST   /admin/guardrails/{name}/detach   `{"model": M}`
  POST   /admin/guardrails/{name}/test     `{"text": T}`: what each detector finds (spans); model
                                           detectors are asked only with `"run_judges": true`

Each change is written to the registry's audit trail first (guardrail.set, guardrail.delete,
guardrail.attach, guardrail.detach; target guardrail:<name>), then to Redis, where every replica
picks it up within EXAMLOPS_GUARDRAIL_REFRESH_S.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from ..governance import MODEL_RE, KeyStore
from ..guardrails import GuardrailStore, JudgeError, Policy, build_rules, check_name, parse_policy, split_names
from ._admin import json_response
from ._audit import audit
from ._body import parse_body, read_body
from ._deps import StateDep, require_admin
from ._errors import OpenAIError, error_responses

router = APIRouter(prefix="/admin/guardrails", tags=["admin"], dependencies=[Depends(require_admin)],
                   responses=error_responses(400, 401, 403, 404, 503))
_BODY_LIMIT = 256 * 1024


class Attach(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="The endpoint (route name) the policy applies to.")


class TestText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(max_length=100_000)
    run_judges: bool = Field(default=False, description="Also ask the policy's model detectors (calls their routes).")


async def _existing(store: GuardrailStore, name: str) -> Policy:
    policy = await store.get(check_name(name))
    if policy is None:
        raise OpenAIError(404, f"no guardrail policy named {name!r}", code="guardrail_not_found", param="name")
    return policy


async def _key_users(state: StateDep, name: str) -> list[str]:
    return [f["id"] for f in await KeyStore(state.redis).all() if name in split_names(f.get("guardrails"))
            and not int(f.get("revoked_ms", "0"))]


@router.put("/{name}")
async def set_policy(request: Request, state: StateDep, name: str) -> Response:
    raw = await read_body(request, _BODY_LIMIT)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise OpenAIError(400, "request body is not valid JSON", code="invalid_json") from None
    policy = parse_policy(name, obj)
    store = GuardrailStore(state.redis)
    before = await store.get(name)
    await audit(state, request, "guardrail.set", f"guardrail:{name}", before.as_json() if before else None,
                policy.as_json())
    await store.put(policy)
    return json_response(policy.as_json())


@router.get("")
async def list_policies(state: StateDep) -> Response:
    policies, endpoints = await GuardrailStore(state.redis).all()
    keys = await KeyStore(state.redis).all()
    rows = [{**p.as_json(), "endpoints": sorted(m for m, names in endpoints.items() if name in names),
             "keys": sorted(f["id"] for f in keys if name in split_names(f.get("guardrails")))}
            for name, p in sorted(policies.items())]
    # version: the policies' in Redis; applied: this replica's copy of them (equal once it has refreshed)
    return json_response({"object": "list", "version": await GuardrailStore(state.redis).version(),
                          "applied": state.guard.book.version, "data": rows})


@router.get("/{name}")
async def get_policy(state: StateDep, name: str) -> Response:
    return json_response((await _existing(GuardrailStore(state.redis), name)).as_json())


@router.delete("/{name}")
async def delete_policy(request: Request, state: StateDep, name: str) -> Response:
    store = GuardrailStore(state.redis)
    policy = await _existing(store, name)
    _, endpoints = await store.all()
    users = [f"endpoint {m}" for m, names in sorted(endpoints.items()) if name in names]
    users += [f"key {k}" for k in await _key_users(state, name)]
    if users:
        raise OpenAIError(400, f"guardrail policy {name!r} is attached to {', '.join(users[:10])}: detach it first",
                          code="guardrail_in_use", param="name")
    await audit(state, request, "guardrail.delete", f"guardrail:{name}", policy.as_json(), None)
    await store.delete(name)
    return json_response({"name": name, "deleted": True})


async def _attachment(request: Request, state: StateDep, name: str, attach: bool) -> Response:
    _, body = await parse_body(request, _BODY_LIMIT, Attach)
    if not MODEL_RE.match(body.model):
        raise OpenAIError(400, f"invalid model name {body.model!r}", code="invalid_value", param="model")
    store = GuardrailStore(state.redis)
    await _existing(store, name)
    _, endpoints = await store.all()
    before = endpoints.get(body.model, ())
    after = tuple(dict.fromkeys((*before, name))) if attach else tuple(n for n in before if n != name)
    if after != before:
        await audit(state, request, "guardrail.attach" if attach else "guardrail.detach", f"guardrail:{name}",
                    {"model": body.model, "policies": list(before)}, {"model": body.model, "policies": list(after)})
        await store.set_attached(body.model, after)
    return json_response({"model": body.model, "policies": list(after)})


@router.post("/{name}/attach")
async def attach(request: Request, state: StateDep, name: str) -> Response:
    return await _attachment(request, state, name, True)


@router.post("/{name}/detach")
async def detach(request: Request, state: StateDep, name: str) -> Response:
    return await _attachment(request, state, name, False)


@router.post("/{name}/test")
async def test_policy(request: Request, state: StateDep, name: str) -> Response:
    """What each detector of the policy finds in a text the operator typed (nothing is logged)."""
    _, body = await parse_body(request, _BODY_LIMIT, TestText)
    policy = await _existing(GuardrailStore(state.redis), name)
    rows: list[dict[str, Any]] = []
    for i, rule in enumerate(build_rules(policy, state.guard.book.ask)):
        e = rule.entry
        row: dict[str, Any] = {"index": i, "detector": e.detector, "direction": e.direction, "action": e.action}
        if rule.detector is None and not body.run_judges:
            row["skipped"] = "a model detector calls its route: run_judges asks it"
            row["findings"] = []
            rows.append(row)
            continue
        try:
            found = rule.detector.scan(body.text) if rule.detector else await rule.judge.scan(body.text)  # type: ignore[union-attr]
        except JudgeError as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            found = []
        row["findings"] = [{"entity": f.entity, "start": f.start, "end": f.end, "score": round(f.score, 3),
                            "text": body.text[f.start:f.end]} for f in found]
        rows.append(row)
    return json_response({"name": name, "results": rows})
