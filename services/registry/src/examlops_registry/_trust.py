"""The public keys whose signatures the registry accepts for model versions.

  {exa:reg}:trusted_keys  HASH  key_id -> TrustedKey (protobuf JSON)

A key and its audit event (model.trust.add / model.trust.remove, target signing_key:<key_id>) are
written in one MULTI/EXEC. The key id is computed here from the key, never taken from the caller.
"""

from __future__ import annotations

from typing import Any

import grpc
import redis.asyncio as redis

from examlops.provenance import SigningError, key_id, load_public_pem, public_pem
from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._checks import Refused, answer, few
from ._prices import _audit
from ._store import AUDIT, from_json, now_ms, to_json

TRUSTED_KEYS = "{exa:reg}:trusted_keys"
Code = grpc.StatusCode


class TrustStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

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
                                                           f"{few(trusted)}", "key_id")
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(TRUSTED_KEYS, kid)
            pipe.xadd(AUDIT, _audit(actor, "model.trust.remove", f"signing_key:{kid}", before, "", now_ms()))
            await pipe.execute()
        return from_json(before, pb.TrustedKey)

    async def trusted(self) -> list[pb.TrustedKey]:
        raw = await self.r.hgetall(TRUSTED_KEYS)
        return sorted((from_json(v, pb.TrustedKey) for v in raw.values()), key=lambda k: (k.name, k.key_id))




class TrustServicerMixin:
    """AddTrustedKey, ListTrustedKeys and RemoveTrustedKey of the Registry service."""

    keys: TrustStore

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
        return await self.keys.trust(key, request.actor)

    async def ListTrustedKeys(self, request: pb.ListTrustedKeysRequest,
                              context: grpc.aio.ServicerContext) -> pb.ListTrustedKeysResponse:
        return pb.ListTrustedKeysResponse(keys=await self.keys.trusted())

    async def RemoveTrustedKey(self, request: pb.RemoveTrustedKeyRequest,
                               context: grpc.aio.ServicerContext) -> pb.TrustedKey:
        return await answer(context, self.keys.distrust(request.key_id, request.actor))
