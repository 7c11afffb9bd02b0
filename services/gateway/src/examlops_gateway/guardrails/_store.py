"""Policies in Redis, and each replica's in-memory copy of them.

With the governance state, under the gateway's hash tag:
  {exa:gw}:guardrails            HASH    policy name -> its JSON (`{"detectors": [...]}`)
  {exa:gw}:guardrails:endpoints  HASH    model -> ",name,name," (policies attached to the endpoint)
  {exa:gw}:guardrails:version    STRING  bumped by every change (MULTI with the change)
A key's own policies are on its record (`guardrails`, ",name,"), read by reserve.lua with the key.

Every replica polls the version every `refresh_s` (one GET) and reloads on a change, so a change
reaches every replica within about that; the request path reads only memory.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import redis.asyncio as redis

from ._detectors import Detector, build_detector
from ._judge import Ask, ModelJudge
from ._policy import Entry, Policy, PolicyError, parse_policy

log = logging.getLogger(__name__)

POLICIES = "{exa:gw}:guardrails"
ENDPOINTS = "{exa:gw}:guardrails:endpoints"
VERSION = "{exa:gw}:guardrails:version"


def names_field(names: list[str] | tuple[str, ...]) -> str:
    """The ",a,b," form stored on key records and endpoint attachments."""
    return "," + ",".join(dict.fromkeys(names)) + "," if names else ""


def split_names(stored: str | None) -> tuple[str, ...]:
    return tuple(n for n in (stored or "").split(",") if n)


class GuardrailStore:
    """Admin-side reads and writes (the request path reads GuardrailBook)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions

    async def get(self, name: str) -> Policy | None:
        raw = await self.r.hget(POLICIES, name)
        return parse_policy(name, orjson.loads(raw)) if raw else None

    async def all(self) -> tuple[dict[str, Policy], dict[str, tuple[str, ...]]]:
        """(policies by name, policy names by model): a stored policy that no longer parses is skipped."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(POLICIES)
            pipe.hgetall(ENDPOINTS)
            raw, attached = await pipe.execute()
        policies: dict[str, Policy] = {}
        for name, text in cast(dict[str, str], raw).items():
            try:
                policies[name] = parse_policy(name, orjson.loads(text))
            except (PolicyError, orjson.JSONDecodeError) as exc:
                log.error("guardrail policy %s is not valid any more and is skipped: %s", name, exc)
        return policies, {m: split_names(v) for m, v in cast(dict[str, str], attached).items() if split_names(v)}

    async def version(self) -> int:
        return int(await self.r.get(VERSION) or 0)

    async def put(self, policy: Policy) -> None:
        await self._change(lambda p: p.hset(POLICIES, policy.name, orjson.dumps(policy.as_json())))

    async def delete(self, name: str) -> None:
        await self._change(lambda p: p.hdel(POLICIES, name))

    async def set_attached(self, model: str, names: tuple[str, ...]) -> None:
        if names:
            await self._change(lambda p: p.hset(ENDPOINTS, model, names_field(names)))
        else:
            await self._change(lambda p: p.hdel(ENDPOINTS, model))

    async def _change(self, write: Any) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            write(pipe)
            pipe.incr(VERSION)
            await pipe.execute()


@dataclass(slots=True)
class Rule:
    """One entry of one policy, built: a CPU detector, or a judge."""

    policy: str
    entry: Entry
    detector: Detector | None = None
    judge: ModelJudge | None = None

    @property
    def hold_chars(self) -> int:
        return self.detector.max_match_chars if self.detector else 0


@dataclass(slots=True)
class Applied:
    """The rules that apply to one call, by direction."""

    policies: tuple[str, ...]
    input: tuple[Rule, ...]
    output: tuple[Rule, ...]
    hold_chars: int = 0              # the longest match an output detector can make
    judged_output: bool = field(default=False)  # an output judge needs the whole answer


def build_rules(policy: Policy, ask: Ask) -> list[Rule]:
    rules = []
    for e in policy.entries:
        if e.detector == "model":
            rules.append(Rule(policy.name, e, judge=ModelJudge(e.route or "", ask, e.timeout_s)))
        else:
            rules.append(Rule(policy.name, e, detector=build_detector(e.detector, list(e.entities) or None,
                                                                        e.pattern)))
    return rules


class GuardrailBook:
    """This replica's copy of the policies and endpoint attachments, refreshed from Redis."""

    def __init__(self, client: redis.Redis, ask: Ask, refresh_s: float = 0.5) -> None:
        self.store, self.ask, self.refresh_s = GuardrailStore(client), ask, refresh_s
        self.rules: dict[str, list[Rule]] = {}
        self.endpoints: dict[str, tuple[str, ...]] = {}
        self.version = -1
        self._applied: dict[tuple[tuple[str, ...], str], Applied | None] = {}

    async def refresh(self) -> None:
        version = await self.store.version()
        if version == self.version:
            return
        policies, endpoints = await self.store.all()
        self.rules = {name: build_rules(p, self.ask) for name, p in policies.items()}
        self.endpoints, self.version, self._applied = endpoints, version, {}

    async def follow(self) -> None:
        while True:
            try:
                await self.refresh()
            except (redis.RedisError, OSError) as exc:
                log.warning("cannot refresh the guardrail policies (keeping the last copy): %s", exc)
            await asyncio.sleep(self.refresh_s)

    def applied(self, key_policies: tuple[str, ...], model: str) -> Applied | None:
        """What applies to a call of this key on this model; None when nothing does (a dict lookup)."""
        if not self.rules:
            return None
        cache_key = (key_policies, model)
        if cache_key not in self._applied:
            names = tuple(n for n in dict.fromkeys(key_policies + self.endpoints.get(model, ())) if n in self.rules)
            rules = [r for n in names for r in self.rules[n]]
            if len(self._applied) > 4096:
                self._applied.clear()
            self._applied[cache_key] = Applied(
                names, tuple(r for r in rules if r.entry.applies("input")),
                tuple(r for r in rules if r.entry.applies("output")),
                hold_chars=max((r.hold_chars for r in rules if r.entry.applies("output")), default=0),
                judged_output=any(r.judge for r in rules if r.entry.applies("output"))) if names else None
        return self._applied[cache_key]

