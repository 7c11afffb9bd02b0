"""Model versions, their evals and aliases, and the keys whose signatures the registry trusts.

  {exa:reg}:model_versions  HASH  "NAME@V" -> ModelVersion (protobuf JSON)
  {exa:reg}:model_aliases   HASH  "NAME@ALIAS" -> V
  {exa:reg}:trusted_keys    HASH  key_id -> TrustedKey (protobuf JSON)

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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
import redis.asyncio as redis
from redis.exceptions import WatchError

from examlops.provenance import (
    BomClaims,
    BomError,
    FileDigest,
    SigningError,
    key_id,
    load_public_pem,
    public_pem,
    read_claims,
    validate_bom,
    verify,
)
from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._checks import refuse_first
from ._prices import _audit
from ._store import AUDIT, PROJECT_RESOURCES, from_json, now_ms, to_json

VERSIONS = "{exa:reg}:model_versions"
ALIASES = "{exa:reg}:model_aliases"
TRUSTED_KEYS = "{exa:reg}:trusted_keys"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NAME_HELP = "use 1-63 characters of A-Z, a-z, 0-9, '.', '_' or '-', starting with a letter or digit"
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}@[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
Code = grpc.StatusCode
FAILED = Code.FAILED_PRECONDITION
R = TypeVar("R")


class Refused(Exception):
    """A request the registry will not carry out: the status code, the reason, the field."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.field = code, reason, field


async def answer(context: grpc.aio.ServicerContext, work: Awaitable[R]) -> R:
    """The result of `work`, or the call ended with the Refused it raised."""
    try:
        return await work
    except Refused as exc:
        await abort(context, exc.code, exc.reason, str(exc), exc.field)


def _few(items: Iterable[str], limit: int = 20) -> str:
    found = sorted(items)
    return ", ".join(found[:limit]) + (f" and {len(found) - limit} more" if len(found) > limit else "") or "none"


def read_bom(text: str) -> BomClaims:
    """What a BOM claims, once it validates against CycloneDX 1.6 (CPU work: run it in a thread)."""
    try:
        validate_bom(text)
    except BomError:
        raise
    except ValueError as exc:  # the validator reads the text as JSON first
        raise BomError(f"the BOM is not JSON: {exc}") from None
    return read_claims(text)


def check_against_bom(mv: pb.ModelVersion, claims: BomClaims) -> None:
    """Refuse a record whose name, files, parent, quantization or degraded mode differ from its BOM's."""
    ref = f"{mv.name}@{mv.version}"
    if (claims.name, claims.version) != (mv.name, mv.version):
        raise Refused(FAILED, "bom_mismatch", f"the BOM describes {claims.name}@{claims.version}, not {ref}: "
                                              "a BOM is signed for one version only", "bom_json")
    if claims.parent and not REF_RE.match(claims.parent):
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", f"the BOM's parent {claims.parent!r} is not NAME@V",
                      "bom_json")
    if len({d.path for d in claims.files}) != len(claims.files):
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", "the BOM lists a file twice", "bom_json")
    if not claims.files and not claims.degraded_reason:
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", f"the BOM of {ref} lists no files", "bom_json")
    problem = files_problem(claims.files, [FileDigest(f.path, f.sha256, f.size) for f in mv.files])
    if problem:
        raise Refused(FAILED, "files_mismatch", f"the files of {ref} differ from its BOM's: {problem}", "files")
    for field, given, claimed in [("parent", mv.parent, claims.parent),
                                  ("quantization", mv.quantization, claims.quantization),
                                  ("degraded_reason", mv.degraded_reason, claims.degraded_reason),
                                  ("degraded", str(mv.degraded).lower(), str(bool(claims.degraded_reason)).lower())]:
        if given != claimed:
            raise Refused(FAILED, "bom_mismatch", f"{field} {given!r} of {ref} differs from its BOM's {claimed!r}",
                          field)


def files_problem(claimed: list[FileDigest], listed: list[FileDigest]) -> str:
    """The first difference between the BOM's files and the listed ones, in words; "" when none."""
    have: dict[str, FileDigest] = {}
    for d in listed:
        if d.path in have:
            return f"{d.path} is listed twice"
        have[d.path] = d
    want = {d.path: d for d in claimed}
    for path in sorted(want.keys() | have.keys()):
        w, h = want.get(path), have.get(path)
        if h is None:
            return f"{path} is in the BOM but not in the files listed"
        if w is None:
            return f"{path} is listed but not in the BOM"
        if (w.sha256, w.size) != (h.sha256, h.size):
            return (f"{path} has SHA-256 {h.sha256[:16]}… ({h.size} bytes), the BOM {w.sha256[:16]}… "
                    f"({w.size} bytes)")
    return ""


def _resolve_failure(name: str, wanted: str, keys: list[str], aliases: list[str]) -> Refused:
    versions = [k.partition("@")[2] for k in keys if k.partition("@")[0] == name]
    if not versions:
        models = {k.partition("@")[0] for k in keys}
        return Refused(Code.NOT_FOUND, "model_not_found",
                       f"no model named {name!r}; registered models: {_few(models)}", "name")
    held = [a.partition("@")[2] for a in aliases if a.partition("@")[0] == name]
    return Refused(Code.NOT_FOUND, "version_not_found", f"{name} has no version or alias {wanted!r}; "
                   f"versions: {_few(versions)}; aliases: {_few(held)}", "version")


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

    async def trust(self, key: pb.TrustedKey, actor: str) -> pb.TrustedKey:
        before = await self.r.hget(TRUSTED_KEYS, key.key_id)
        key.added_at_ms, key.added_by = now_ms(), current_caller().name
        after = to_json(key)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(TRUSTED_KEYS, key.key_id, after)
            pipe.xadd(AUDIT, _audit(actor, "model.trust.add", f"signing_key:{key.key_id}", before or "", after,
                                    key.added_at_ms))
            await pipe.execute()
        return key

    async def distrust(self, kid: str, actor: str) -> pb.TrustedKey:
        before = await self.r.hget(TRUSTED_KEYS, kid)
        if before is None:
            trusted = await self.r.hkeys(TRUSTED_KEYS)
            raise Refused(Code.NOT_FOUND, "key_not_found", f"key {kid!r} is not trusted; trusted keys: "
                                                           f"{_few(trusted)}", "key_id")
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(TRUSTED_KEYS, kid)
            pipe.xadd(AUDIT, _audit(actor, "model.trust.remove", f"signing_key:{kid}", before, "", now_ms()))
            await pipe.execute()
        return from_json(before, pb.TrustedKey)

    async def trusted(self) -> list[pb.TrustedKey]:
        raw = await self.r.hgetall(TRUSTED_KEYS)
        return sorted((from_json(v, pb.TrustedKey) for v in raw.values()), key=lambda k: (k.name, k.key_id))


def check_stored(mv: pb.ModelVersion) -> None:
    """A stored record still matches its (signed) BOM: its digest, its name, its files and claims."""
    if hashlib.sha256(mv.bom_json.encode()).hexdigest() != mv.bom_sha256:
        raise Refused(FAILED, "bom_mismatch", f"the BOM of {mv.name}@{mv.version} no longer has the SHA-256 "
                                              "recorded at registration", "bom_json")
    try:
        claims = read_claims(mv.bom_json)
    except BomError as exc:
        raise Refused(FAILED, "bom_invalid", str(exc), "bom_json") from None
    check_against_bom(mv, claims)


class VersionsServicerMixin:
    """Model versions, evals, aliases and trusted keys of the Registry service."""

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

    async def AddTrustedKey(self, request: pb.AddTrustedKeyRequest,
                            context: grpc.aio.ServicerContext) -> pb.TrustedKey:
        given = request.key
        try:
            public = load_public_pem(given.public_key_pem, "public_key_pem")
        except SigningError as exc:
            await abort(context, Code.INVALID_ARGUMENT, "invalid_key", str(exc), "public_key_pem")
        kid = key_id(public)
        if given.key_id and given.key_id != kid:
            await abort(context, Code.INVALID_ARGUMENT, "key_id_mismatch",
                        f"key_id {given.key_id!r} is not the id of this public key ({kid})", "key_id")
        key = pb.TrustedKey(key_id=kid, public_key_pem=public_pem(public), name=given.name)
        return await self.versions.trust(key, request.actor)

    async def ListTrustedKeys(self, request: pb.ListTrustedKeysRequest,
                              context: grpc.aio.ServicerContext) -> pb.ListTrustedKeysResponse:
        return pb.ListTrustedKeysResponse(keys=await self.versions.trusted())

    async def RemoveTrustedKey(self, request: pb.RemoveTrustedKeyRequest,
                               context: grpc.aio.ServicerContext) -> pb.TrustedKey:
        return await answer(context, self.versions.distrust(request.key_id, request.actor))
