"""Model versions, their evals and aliases (the keys they are checked against: _trust.py).

  {exa:reg}:model_versions  HASH  "NAME@V" -> ModelVersion (protobuf JSON)
  {exa:reg}:model_aliases   HASH  "NAME@ALIAS" -> V

A version is immutable once registered: only its evals and aliases change. It is recorded only when
its CycloneDX BOM validates, names NAME@V, lists exactly the files of the request, and carries an
Ed25519 signature by a trusted key; its parent, quantization and degraded mode are read from the
BOM, never from the request. Promote checks the signature again against the keys trusted at that
moment. Each change and its audit event (and a version's project attribution) are written in one
MULTI/EXEC guarded by WATCH on the hashes the checks read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import redis.asyncio as redis
from redis.exceptions import WatchError

from examlops.provenance import BomClaims, BomError, load_public_pem, verify
from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._bom_checks import check_against_bom, check_stored, read_bom
from ._checks import R, Refused, answer, few, refuse_first
from ._prices import _audit
from ._store import AUDIT, PROJECT_RESOURCES, from_json, now_ms, to_json
from ._trust import TRUSTED_KEYS

VERSIONS = "{exa:reg}:model_versions"
ALIASES = "{exa:reg}:model_aliases"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NAME_HELP = "use 1-63 characters of A-Z, a-z, 0-9, '.', '_' or '-', starting with a letter or digit"
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
Code = grpc.StatusCode
FAILED = Code.FAILED_PRECONDITION


def _resolve_failure(name: str, wanted: str, keys: list[str], aliases: list[str]) -> Refused:
    versions = [k.partition("@")[2] for k in keys if k.partition("@")[0] == name]
    if not versions:
        models = {k.partition("@")[0] for k in keys}
        return Refused(Code.NOT_FOUND, "model_not_found",
                       f"no model named {name!r}; registered models: {few(models)}", "name")
    held = [a.partition("@")[2] for a in aliases if a.partition("@")[0] == name]
    return Refused(Code.NOT_FOUND, "version_not_found", f"{name} has no version or alias {wanted!r}; "
                   f"versions: {few(versions)}; aliases: {few(held)}", "version")


class VersionStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def _transact(self, body: Callable[[Any], Awaitable[R]]) -> R:
        """Run `body(pipe)` (reads, then pipe.multi() and the writes) until no watched hash changed under it."""
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(VERSIONS, ALIASES, TRUSTED_KEYS)
                    return await body(pipe)
                except WatchError:
                    continue

    @staticmethod
    async def _resolve(r: Any, name: str, wanted: str) -> pb.ModelVersion:
        raw = await r.hget(VERSIONS, f"{name}@{wanted}")
        if raw is None and ALIAS_RE.match(wanted):
            target = await r.hget(ALIASES, f"{name}@{wanted}")
            raw = await r.hget(VERSIONS, f"{name}@{target}") if target is not None else None
        if raw is None:
            raise _resolve_failure(name, wanted, await r.hkeys(VERSIONS), await r.hkeys(ALIASES))
        return from_json(raw, pb.ModelVersion)

    @staticmethod
    async def _check_signature(r: Any, mv: pb.ModelVersion) -> None:
        """The signature over bom_json verifies with the key `key_id`, trusted now."""
        ref = f"{mv.name}@{mv.version}"
        raw = await r.hget(TRUSTED_KEYS, mv.key_id)
        if raw is None:
            raise Refused(FAILED, "untrusted_key", f"{ref} is signed by untrusted key {mv.key_id}; trust it with "
                                                   "`exa models trust add PUBFILE`", "key_id")
        trusted = from_json(raw, pb.TrustedKey)
        if not verify(load_public_pem(trusted.public_key_pem, f"trusted key {mv.key_id}"), mv.bom_json, mv.signature):
            raise Refused(FAILED, "bad_signature", f"the signature of {ref} does not verify with key {mv.key_id}: "
                                                   "the BOM or its signature was changed after signing", "signature")

    async def register(self, mv: pb.ModelVersion, claims: BomClaims, actor: str) -> pb.ModelVersion:
        ref = f"{mv.name}@{mv.version}"
        out = pb.ModelVersion()
        out.CopyFrom(mv)
        for field in ("evals", "aliases", "files"):
            out.ClearField(field)
        out.files.extend(pb.FileDigest(path=d.path, sha256=d.sha256, size=d.size) for d in claims.files)
        out.parent, out.quantization = claims.parent, claims.quantization
        out.degraded, out.degraded_reason = bool(claims.degraded_reason), claims.degraded_reason
        out.created_by = current_caller().name
        out.bom_sha256 = hashlib.sha256(mv.bom_json.encode()).hexdigest()

        async def body(pipe: Any) -> pb.ModelVersion:
            if await pipe.hexists(VERSIONS, ref):
                raise Refused(Code.ALREADY_EXISTS, "version_exists", f"{ref} is already registered and versions are "
                                                                     "immutable: register another version", "version")
            if await pipe.hexists(ALIASES, ref):
                raise Refused(FAILED, "version_is_alias", f"{mv.version!r} is an alias of {mv.name}: "
                                                          "choose another version", "version")
            await self._check_signature(pipe, mv)
            if claims.parent and not await pipe.hexists(VERSIONS, claims.parent):
                raise Refused(FAILED, "parent_unknown", f"the parent of {ref}, {claims.parent}, is not registered: "
                                                        "register it first", "parent")
            out.created_at_ms = now_ms()
            after = to_json(out)
            pipe.multi()
            pipe.hset(VERSIONS, ref, after)
            if out.project:
                res = pb.ProjectResource(project=out.project, kind="model_version", name=ref,
                                         created_at_ms=out.created_at_ms)
                pipe.hset(PROJECT_RESOURCES, f"model_version:{ref}", to_json(res))
            pipe.xadd(AUDIT, _audit(actor, "model.register", f"model:{ref}", "", after, out.created_at_ms))
            await pipe.execute()
            return out

        return await self._transact(body)

    async def get(self, name: str, wanted: str) -> pb.ModelVersion:
        return await self._resolve(self.r, name, wanted)

    async def all(self, name: str = "") -> list[pb.ModelVersion]:
        raw = await self.r.hgetall(VERSIONS)
        found = [from_json(v, pb.ModelVersion) for k, v in raw.items() if not name or k.partition("@")[0] == name]
        return sorted(found, key=lambda v: (v.name, v.created_at_ms, v.version))

    async def record_eval(self, name: str, wanted: str, result: pb.EvalResult, actor: str) -> pb.ModelVersion:
        async def body(pipe: Any) -> pb.ModelVersion:
            mv = await self._resolve(pipe, name, wanted)
            ref = f"{mv.name}@{mv.version}"
            if result.bom_sha256 != mv.bom_sha256:
                raise Refused(FAILED, "eval_mismatch", f"the eval was of other files: its BOM SHA-256 "
                              f"{result.bom_sha256[:16] or '(none)'}… is not {ref}'s {mv.bom_sha256[:16]}…",
                              "result.bom_sha256")
            ev = pb.EvalResult()
            ev.CopyFrom(result)
            ev.time_ms, ev.actor = now_ms(), current_caller().name
            mv.evals.append(ev)
            pipe.multi()
            pipe.hset(VERSIONS, ref, to_json(mv))
            pipe.xadd(AUDIT, _audit(actor, "model.eval", f"model:{ref}", "", to_json(ev), ev.time_ms))
            await pipe.execute()
            return mv

        return await self._transact(body)

    async def promote(self, req: pb.PromoteRequest) -> pb.ModelVersion:
        async def body(pipe: Any) -> pb.ModelVersion:
            mv = await self._resolve(pipe, req.name, req.version)
            ref = f"{mv.name}@{mv.version}"
            if await pipe.hexists(VERSIONS, f"{mv.name}@{req.alias}"):
                raise Refused(FAILED, "alias_is_version", f"{req.alias!r} is a version of {mv.name}, "
                                                          "not an alias: choose another alias", "alias")
            if mv.degraded:
                raise Refused(FAILED, "degraded", f"{ref} is degraded ({mv.degraded_reason}): it was recorded, "
                                                  "not produced, and cannot be served", "version")
            await self._check_signature(pipe, mv)
            check_stored(mv)
            if not req.force and not mv.evals:
                raise Refused(FAILED, "eval_missing", f"{ref} has no eval: record a passing eval first, "
                                                      "or force the promotion with a reason", "version")
            if not req.force and not mv.evals[-1].passed:
                raise Refused(FAILED, "eval_failed", f"the latest eval of {ref} failed "
                                                     f"({mv.evals[-1].reason or mv.evals[-1].gate}): "
                                                     "it cannot be promoted without force and a reason", "version")
            field = f"{mv.name}@{req.alias}"
            previous = await pipe.hget(ALIASES, field)
            held: pb.ModelVersion | None = None
            if previous is not None and previous != mv.version:
                raw = await pipe.hget(VERSIONS, f"{mv.name}@{previous}")
                held = from_json(raw, pb.ModelVersion) if raw is not None else None
            if held is not None:
                kept = [a for a in held.aliases if a != req.alias]
                held.ClearField("aliases")
                held.aliases.extend(kept)
            if req.alias not in mv.aliases:
                mv.aliases.append(req.alias)
            t = now_ms()
            before = json.dumps({"alias": req.alias, "version": previous}) if previous is not None else ""
            after = json.dumps({"alias": req.alias, "version": mv.version, "force": req.force,
                                "reason": req.reason, "latest_eval_passed": bool(mv.evals and mv.evals[-1].passed)})
            action = "model.promote.force" if req.force else "model.promote"
            pipe.multi()
            pipe.hset(ALIASES, field, mv.version)
            pipe.hset(VERSIONS, ref, to_json(mv))
            if held is not None:
                pipe.hset(VERSIONS, f"{held.name}@{held.version}", to_json(held))
            pipe.xadd(AUDIT, _audit(req.actor, action, f"model:{ref}", before, after, t))
            await pipe.execute()
            return mv

        return await self._transact(body)

class VersionsServicerMixin:
    """Model versions, evals and aliases of the Registry service."""

    versions: VersionStore

    async def RegisterModelVersion(self, request: pb.RegisterModelVersionRequest,
                                   context: grpc.aio.ServicerContext) -> pb.ModelVersion:
        mv = request.version
        await refuse_first(context, "invalid_model_version", [
            ("name", not NAME_RE.match(mv.name), f"invalid model name {mv.name!r}: {NAME_HELP}"),
            ("version", not NAME_RE.match(mv.version), f"invalid version {mv.version!r}: {NAME_HELP}"),
        ])
        ref = f"{mv.name}@{mv.version}"
        if not mv.signature:
            await abort(context, FAILED, "unsigned", f"{ref} is unsigned: sign its BOM (EXAMLOPS_SIGNING_KEY) with a "
                                                     "key the registry trusts", "signature")
        if not mv.key_id:
            await abort(context, Code.INVALID_ARGUMENT, "invalid_model_version",
                        f"{ref} is signed but names no key_id", "key_id")
        try:
            claims = await asyncio.to_thread(read_bom, mv.bom_json)
        except BomError as exc:
            await abort(context, Code.INVALID_ARGUMENT, "bom_invalid", f"{ref}: {exc}", "bom_json")

        async def register() -> pb.ModelVersion:
            check_against_bom(mv, claims)
            return await self.versions.register(mv, claims, request.actor)

        return await answer(context, register())

    async def GetModelVersion(self, request: pb.GetModelVersionRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelVersion:
        return await answer(context, self.versions.get(request.name, request.version))

    async def ListModelVersions(self, request: pb.ListModelVersionsRequest,
                                context: grpc.aio.ServicerContext) -> pb.ListModelVersionsResponse:
        return pb.ListModelVersionsResponse(versions=await self.versions.all(request.name))

    async def RecordEval(self, request: pb.RecordEvalRequest, context: grpc.aio.ServicerContext) -> pb.ModelVersion:
        res = request.result
        await refuse_first(context, "invalid_eval", [
            ("result.task_score", not 0 <= res.task_score <= 1, "task_score is a share: between 0 and 1"),
            ("result.task_count", res.task_count < 0, "task_count cannot be negative"),
            ("result.perplexity", not res.perplexity >= 0, "perplexity cannot be negative"),
        ])
        return await answer(context, self.versions.record_eval(request.name, request.version, res, request.actor))

    async def Promote(self, request: pb.PromoteRequest, context: grpc.aio.ServicerContext) -> pb.ModelVersion:
        await refuse_first(context, "invalid_promotion", [
            ("alias", not ALIAS_RE.match(request.alias), f"invalid alias {request.alias!r}: use 1-32 characters "
                                                         "of A-Z, a-z, 0-9, '_' or '-', starting with a letter"),
            ("reason", request.force and not request.reason.strip(),
             "a forced promotion needs a reason: skipping the eval gate is audited with it"),
        ])
        return await answer(context, self.versions.promote(request))
