"""Virtual keys: the secret's format, its hash, and the key records in Redis.

A virtual key reads `sk-exa-<id>-<secret>`: the 12-hex-digit id names the key's Redis keys, so the
gateway finds the record without a lookup, and the 256-bit secret is never stored: the record
holds the SHA-256 of the whole key (a slow hash buys nothing against a 256-bit secret).

Every Redis key of one virtual key shares the hash tag `{vk:<id>}`, so the Lua scripts that touch
them run on Redis Cluster too:
  {vk:<id>}:key   HASH    id, hash, tenant, project, models (",a,b,"), budget (micro-USD, -1: none),
                          rpm, tpm (0: none), expires_ms, revoked_ms, created_ms (0: never),
                          guardrails (",name," guardrail policies, see guardrails/_store.py);
                          spent, reserved (micro-USD), requests, prompt_tokens, completion_tokens,
                          reaped; rpm_tat, tpm_tat (GCRA state, ms)
  {vk:<id>}:res   HASH    open reservations (reserve.lua) and "reaped:<res_id>" markers (reap.lua)
  {vk:<id>}:cost  STREAM  one cost record per call (append_cost in lua/_prelude.lua)
  {exa:gw}:keys   SET     every key id (listing, the reaper, the spend summary)
The admin key is recorded under the id `admin` (no reservations, no limits).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as redis

from ._prices import MICRO

PREFIX = "sk-exa-"
ID_LEN = 12
ADMIN_ID = "admin"
KEY_INDEX = "{exa:gw}:keys"
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_ID_RE = re.compile(r"^[0-9a-f]{12}$")


def redis_keys(key_id: str) -> list[str]:
    """The key's record, its reservations and its cost stream, under one hash tag."""
    tag = "{vk:" + key_id + "}"
    return [tag + ":key", tag + ":res", tag + ":cost"]


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(id, the virtual key): shown once, never stored."""
    key_id = secrets.token_hex(ID_LEN // 2)
    return key_id, f"{PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


def parse_key(token: str) -> str | None:
    """The key id of a well-formed virtual key, None otherwise (no I/O)."""
    if not token.startswith(PREFIX) or len(token) < len(PREFIX) + ID_LEN + 2:
        return None
    key_id = token[len(PREFIX):len(PREFIX) + ID_LEN]
    if token[len(PREFIX) + ID_LEN] != "-" or not _ID_RE.match(key_id):
        return None
    return key_id


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class KeyLimits:
    """What an operator sets on a key; None leaves a field as it is on update."""

    models: list[str] | None = None
    budget_micro: int | None = None      # -1 removes the budget
    rpm: int | None = None               # 0 removes the limit
    tpm: int | None = None
    expires_ms: int | None = None        # 0: never
    guardrails: list[str] | None = None  # guardrail policy names ([] removes them)

    def fields(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.models is not None:
            out["models"] = "," + ",".join(self.models) + ","
        if self.guardrails is not None:
            out["guardrails"] = "," + ",".join(self.guardrails) + "," if self.guardrails else ""
        for name, value in (("budget", self.budget_micro), ("rpm", self.rpm), ("tpm", self.tpm),
                            ("expires_ms", self.expires_ms)):
            if value is not None:
                out[name] = str(value)
        return out


def public_row(f: dict[str, str], clock_ms: int) -> dict[str, Any]:
    """A key as operators see it: amounts in USD (and exact micro-USD), never the hash. `clock_ms` is
    Redis' clock (KeyStore.clock_ms), the one the scripts judge expiry by."""
    budget = int(f.get("budget", "-1"))
    spent, reserved = int(f.get("spent", "0")), int(f.get("reserved", "0"))
    expires, revoked = int(f.get("expires_ms", "0")), int(f.get("revoked_ms", "0"))
    state = "revoked" if revoked else "expired" if expires and expires <= clock_ms else "active"
    return {
        "id": f["id"], "tenant": f.get("tenant", ""), "project": f.get("project", ""),
        "models": [m for m in f.get("models", "").split(",") if m],
        "guardrails": [g for g in f.get("guardrails", "").split(",") if g],
        "budget": budget / MICRO if budget >= 0 else None,
        "spend": spent / MICRO,
        "remaining": max(budget - spent, 0) / MICRO if budget >= 0 else None,
        "reserved": reserved / MICRO,
        "requests": int(f.get("requests", "0")),
        "prompt_tokens": int(f.get("prompt_tokens", "0")),
        "completion_tokens": int(f.get("completion_tokens", "0")),
        "rpm": int(f.get("rpm", "0")) or None, "tpm": int(f.get("tpm", "0")) or None,
        "expires_at": expires // 1000 if expires else None,
        "revoked_at": revoked // 1000 if revoked else None,
        "created_at": int(f.get("created_ms", "0")) // 1000,
        "state": state,
        "budget_micro_usd": budget if budget >= 0 else None,
        "spend_micro_usd": spent,
        "reserved_micro_usd": reserved,
        "reaped": int(f.get("reaped", "0")),
    }


class KeyStore:
    """Key records for the admin API (the hot path reads them only inside reserve.lua)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def create(self, key_id: str, token: str, tenant: str, project: str, limits: KeyLimits) -> dict[str, str]:
        record = {
            "id": key_id, "hash": digest(token), "tenant": tenant, "project": project,
            "models": ",", "budget": "-1", "rpm": "0", "tpm": "0", "expires_ms": "0", "revoked_ms": "0",
            "created_ms": str(now_ms()), "spent": "0", "reserved": "0", "requests": "0",
            "prompt_tokens": "0", "completion_tokens": "0", "reaped": "0", "rpm_tat": "0", "tpm_tat": "0",
            **limits.fields(),
        }
        # Index first: a key is never live without being listed (and reaped).
        await self.r.sadd(KEY_INDEX, key_id)
        await self.r.hset(redis_keys(key_id)[0], mapping=cast(Any, record))
        return record

    async def clock_ms(self) -> int:
        """Redis' clock, which the scripts judge a key's expiry by."""
        secs, micros = await self.r.time()
        return int(secs) * 1000 + int(micros) // 1000

    async def get(self, key_id: str) -> dict[str, str] | None:
        if not _ID_RE.match(key_id):
            return None
        f = cast(dict[str, str], await self.r.hgetall(redis_keys(key_id)[0]))
        return f if f.get("hash") else None

    async def ids(self) -> list[str]:
        return sorted(cast(set[str], await self.r.smembers(KEY_INDEX)))

    async def all(self) -> list[dict[str, str]]:
        ids = await self.ids()
        async with self.r.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hgetall(redis_keys(key_id)[0])
            found: list[dict[str, str]] = await pipe.execute()
        return [f for f in found if f.get("hash")]

    async def update(self, key_id: str, fields: dict[str, str]) -> dict[str, str]:
        await self.r.hset(redis_keys(key_id)[0], mapping=cast(Any, fields))
        return cast(dict[str, str], await self.r.hgetall(redis_keys(key_id)[0]))
