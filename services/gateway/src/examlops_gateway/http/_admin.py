"""The admin HTTP API (admin key only): virtual keys, the spend summary, the prices in use.

  POST /admin/keys                 issue a key; the answer carries `virtual_key`, shown this once
  GET  /admin/keys                 every key with spend, budget, remaining, requests (?include_revoked)
  GET  /admin/keys/{id}            one key
  PATCH /admin/keys/{id}           change budget, limits, models or expiry
  POST /admin/keys/{id}/revoke     revoke (the record and its spend stay)
  GET  /admin/spend                requests, tokens and cost by key, project, model or tenant
  GET  /admin/prices               the price table this replica uses

Each mutation is written to the registry's audit trail (key.issue, key.update, key.revoke; target
key:<id>) before it is applied: no change exists without its audit event. The actor is the
`X-Examlops-Actor` header (the CLI sends the operator's name).
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import orjson
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from examlops.registry.v1 import registry_pb2 as reg

from .._state import GatewayState
from ..governance import GROUPS, MODEL_RE, KeyLimits, KeyStore, new_key, now_ms, public_row, spend_summary, usd_to_micro
from ..guardrails import GuardrailStore, check_name
from ._audit import audit
from ._body import parse_body
from ._deps import StateDep, require_admin
from ._errors import OpenAIError, error_responses
from ._openapi import parsed_body

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)],
                   responses=error_responses(400, 401, 403, 404, 413, 503))
_ADMIN_BODY_LIMIT = 1024 * 1024


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget_usd: float | None = Field(default=None, ge=0, description="USD; null: no budget")
    rpm: int | None = Field(default=None, ge=1, description="requests per minute; null: no limit")
    tpm: int | None = Field(default=None, ge=1, description="tokens per minute; null: no limit")
    expires_at: int | None = Field(default=None, description="unix seconds; null: never")


class IssueKey(_Limits):
    guardrails: list[str] = Field(default_factory=list, max_length=16, description="guardrail policy names")
    tenant: str = Field(min_length=1, max_length=128)
    project: str = Field(min_length=1, max_length=128)
    models: list[str] = Field(min_length=1, max_length=256)


class UpdateKey(_Limits):
    models: list[str] | None = Field(default=None, min_length=1, max_length=256)
    guardrails: list[str] | None = Field(default=None, max_length=16, description="replaces them; [] removes all")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _check(models: list[str] | None, expires_at: int | None) -> None:
    for m in models or ():
        if not MODEL_RE.match(m):
            raise OpenAIError(400, f"invalid model name {m!r}", code="invalid_value", param="models")
    if expires_at is not None and expires_at <= time.time():
        raise OpenAIError(400, "expires_at is in the past", code="invalid_value", param="expires_at")


async def _guardrails(state: GatewayState, names: list[str] | None) -> list[str] | None:
    """The key's guardrail policies, each of which must exist."""
    store = GuardrailStore(state.redis)
    for name in names or ():
        if await store.get(check_name(name, "guardrails")) is None:
            raise OpenAIError(400, f"no guardrail policy named {name!r} (exa gateway guardrail list)",
                              code="invalid_value", param="guardrails")
    return list(dict.fromkeys(names)) if names is not None else None


def _limits(body: _Limits, models: list[str] | None, guardrails: list[str] | None = None) -> KeyLimits:
    """Only the fields the request set; null clears a limit."""
    sent = body.model_fields_set
    out = KeyLimits(models=sorted(set(models)) if models is not None else None, guardrails=guardrails)
    if "budget_usd" in sent:
        out.budget_micro = -1 if body.budget_usd is None else usd_to_micro(body.budget_usd)
    if "rpm" in sent:
        out.rpm = body.rpm or 0
    if "tpm" in sent:
        out.tpm = body.tpm or 0
    if "expires_at" in sent:
        out.expires_ms = (body.expires_at or 0) * 1000
    return out


async def _existing(store: KeyStore, key_id: str) -> dict[str, str]:
    f = await store.get(key_id)
    if f is None:
        raise OpenAIError(404, f"no virtual key with id {key_id!r}", code="key_not_found", param="id")
    return f


@router.post("/keys", status_code=201, openapi_extra=parsed_body(IssueKey))
async def issue_key(request: Request, state: StateDep) -> Response:
    _, body = await parse_body(request, _ADMIN_BODY_LIMIT, IssueKey)
    _check(body.models, body.expires_at)
    key_id, token = new_key()
    limits = _limits(body, body.models, await _guardrails(state, body.guardrails))
    store = KeyStore(state.redis)
    clock = await store.clock_ms()
    preview = public_row({"id": key_id, "tenant": body.tenant, "project": body.project, "created_ms": str(now_ms()),
                          **limits.fields()}, clock)
    await audit(state, request, "key.issue", f"key:{key_id}", None, preview)
    try:
        await state.registry.AttributeResource(reg.AttributeResourceRequest(
            resource=reg.ProjectResource(project=body.project, kind="virtual_key", name=key_id),
            actor=request.headers.get("x-examlops-actor") or "admin"), timeout=5)
    except grpc.aio.AioRpcError as exc:
        raise OpenAIError(503, f"cannot attribute the key to project {body.project!r} ({exc.code().name})",
                          type="service_unavailable", code="registry_unavailable") from None
    record = await store.create(key_id, token, body.tenant, body.project, limits)
    return json_response({"virtual_key": token, **public_row(record, clock)}, 201)


@router.get("/keys")
async def list_keys(state: StateDep, include_revoked: bool = False) -> Response:
    store = KeyStore(state.redis)
    clock = await store.clock_ms()
    rows = [public_row(f, clock) for f in await store.all()]
    rows = [r for r in rows if include_revoked or r["state"] != "revoked"]
    rows.sort(key=lambda r: (r["tenant"], r["project"], r["created_at"], r["id"]))
    return json_response({"object": "list", "data": rows})


@router.get("/keys/{key_id}")
async def get_key(state: StateDep, key_id: str) -> Response:
    store = KeyStore(state.redis)
    return json_response(public_row(await _existing(store, key_id), await store.clock_ms()))


@router.patch("/keys/{key_id}", openapi_extra=parsed_body(UpdateKey))
async def update_key(request: Request, state: StateDep, key_id: str) -> Response:
    _, body = await parse_body(request, _ADMIN_BODY_LIMIT, UpdateKey)
    _check(body.models, body.expires_at)
    store = KeyStore(state.redis)
    before = await _existing(store, key_id)
    fields = _limits(body, body.models, await _guardrails(state, body.guardrails)).fields()
    if not fields:
        raise OpenAIError(400, "nothing to change: give budget_usd, rpm, tpm, models, guardrails or expires_at",
                          code="invalid_value")
    clock = await store.clock_ms()
    await audit(state, request, "key.update", f"key:{key_id}", public_row(before, clock),
                 public_row({**before, **fields}, clock))
    return json_response(public_row(await store.update(key_id, fields), clock))


@router.post("/keys/{key_id}/revoke")
async def revoke_key(request: Request, state: StateDep, key_id: str) -> Response:
    store = KeyStore(state.redis)
    before, clock = await _existing(store, key_id), await store.clock_ms()
    if int(before.get("revoked_ms", "0")):
        return json_response(public_row(before, clock))
    fields = {"revoked_ms": str(now_ms())}
    await audit(state, request, "key.revoke", f"key:{key_id}", public_row(before, clock),
                 public_row({**before, **fields}, clock))
    return json_response(public_row(await store.update(key_id, fields), clock))


@router.get("/spend")
async def spend(state: StateDep, group_by: str = "key", since: int = 0) -> Response:
    """`since`: unix seconds (0: all the records kept)."""
    if group_by not in GROUPS:
        raise OpenAIError(400, f"group_by must be one of {', '.join(GROUPS)}", code="invalid_value", param="group_by")
    ids = await KeyStore(state.redis).ids()
    return json_response({"object": "list", "group_by": group_by,
                  "data": await spend_summary(state.redis, ids, group_by, since * 1000)})


@router.get("/prices")
async def prices(state: StateDep) -> Response:
    return json_response({"object": "list", "synced": state.prices.synced.is_set(), "data": [
        {"model": m, "input_per_mtok": p.input_micro_per_mtok / 1e6, "output_per_mtok": p.output_micro_per_mtok / 1e6}
        for m, p in sorted(state.prices.prices.items())]})
