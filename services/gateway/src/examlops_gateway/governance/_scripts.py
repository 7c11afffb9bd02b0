"""The Lua scripts' boundary: loading them, their arguments and their replies, each in one place.

A script's ARGV is built from a named dataclass (`ReserveArgs`, `SettleArgs`, `ProgressArgs`) and its reply is read
once into a typed object (`Admission`, the models of a key) or a `Denied`; nothing else indexes
ARGV or a reply by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import overload

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script

from ._cost import DENIALS
from ._errors import Denied

Reply = list[str]  # what the scripts answer (the client decodes responses)


@cache
def script_source(name: str) -> str:
    """A script of lua/ with the shared prelude in front (Redis scripts cannot import each other)."""
    lua = resources.files(__package__).joinpath("lua")
    return lua.joinpath("_prelude.lua").read_text() + lua.joinpath(name).read_text()


@overload
def load_script(client: aioredis.Redis, name: str) -> AsyncScript: ...
@overload
def load_script(client: redis.Redis, name: str) -> Script: ...
def load_script(client: aioredis.Redis | redis.Redis, name: str) -> AsyncScript | Script:
    """A redis-py Script (EVALSHA, loaded again after a Redis restart)."""
    return client.register_script(script_source(name))


def refusal(reply: Reply, key_id: str, model: str) -> Denied:
    """A script's {"deny", code, detail}, counted by reason."""
    DENIALS.labels(reply[1]).inc()
    return Denied(reply[1], reply[2], key_id=key_id, model=model)


@dataclass(frozen=True, slots=True)
class ReserveArgs:
    """reserve.lua's ARGV, by name (the script's header says what each is)."""

    key_hash: str
    model: str
    res_id: str
    replica_id: str
    prompt_tokens: int          # an upper bound
    prompt_cost: int            # prompt tokens x input micro-USD per Mtok
    output_rate: int            # n x output micro-USD per Mtok
    n: int
    max_tokens_asked: int       # 0: none
    default_max_tokens: int     # when none is asked and the key is bounded
    priced: bool
    lease_ms: int

    def argv(self) -> list[str | int]:
        return [self.key_hash, self.model, self.res_id, self.replica_id, self.prompt_tokens, self.prompt_cost,
                self.output_rate, self.n, self.max_tokens_asked, self.default_max_tokens, int(self.priced),
                self.lease_ms]


@dataclass(frozen=True, slots=True)
class SettleArgs:
    """settle.lua's ARGV, by name."""

    res_id: str                 # '' for the admin key, which reserves nothing
    cost_micro: int
    prompt_tokens: int
    completion_tokens: int
    key_id: str
    model: str
    status: str
    latency_ms: float
    ttft_ms: float
    stream: bool
    estimated: bool             # usage not reported by the engine
    priced: bool
    trim_ms: int                # trim cost records older than this (0: keep all)
    guarded: str = ""           # what the guardrails did ('' : nothing fired)
    cache: str = ""             # what the response cache did ('': no cache policy applied)
    provider: str = "prices"    # the cost provider (EXAMLOPS_LLM_COST_PROVIDER)
    basis: str = ""             # how the provider computed the cost ('' for prices)
    clamped: int = 0            # micro-USD the provider asked above the reservation, not charged

    def argv(self) -> list[str | int | float]:
        return [self.res_id, self.cost_micro, self.prompt_tokens, self.completion_tokens, self.key_id, self.model,
                self.status, self.latency_ms, self.ttft_ms, int(self.stream), int(self.estimated), int(self.priced),
                self.trim_ms, self.guarded, self.cache, self.provider, self.basis, self.clamped]


@dataclass(frozen=True, slots=True)
class ProgressArgs:
    """progress.lua's ARGV, by name: what an open call has delivered so far (the reaper's due)."""

    res_id: str
    cost_micro: int
    prompt_tokens: int
    completion_tokens: int

    def argv(self) -> list[str | int]:
        return [self.res_id, self.cost_micro, self.prompt_tokens, self.completion_tokens]


@dataclass(frozen=True, slots=True)
class Admission:
    """reserve.lua's yes: what was reserved, and the output bound the engine must be sent."""

    max_tokens: int             # per choice
    reserved_micro: int
    tenant: str
    project: str
    bounded: bool               # the key has a budget or a TPM: max_tokens must reach the engine
    guardrails: tuple[str, ...] = ()  # the key's guardrail policies
    budgeted: bool = False      # the key has a budget

    @classmethod
    def from_reply(cls, reply: Reply, key_id: str, model: str) -> Admission:
        """The decision, or raises Denied."""
        if reply[0] != "ok":
            raise refusal(reply, key_id, model)
        return cls(max_tokens=int(reply[1]), reserved_micro=int(reply[2]), tenant=reply[3], project=reply[4],
                   bounded=reply[5] == "1", guardrails=tuple(n for n in reply[6].split(",") if n),
                   budgeted=reply[7] == "1")


def allowed_models(reply: Reply, key_id: str) -> set[str]:
    """key_models.lua's answer: the key's allow-list, or raises Denied."""
    if reply[0] != "ok":
        raise refusal(reply, key_id, "")
    return {m for m in reply[1].split(",") if m}
