"""Governance on the request path: one Redis round trip to admit a call, one to settle it.

admit(): reserve.lua authenticates the virtual key, checks the allow-list, the budget and the rate
limits and reserves, atomically. The admin key skips it (every model, no budget, no limit).
Ticket.settle(): settle.lua charges the real cost and appends the cost record, exactly once per
call, whether the call ends normally, fails in the engine or loses its client.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis.asyncio as redis

from examlops.engineproxy.v1 import engineproxy_pb2 as pb

from ._budget import cost_micro_usd, estimate_prompt_tokens, requested_max_tokens, with_max_tokens
from ._cost import DENIALS, OVERRUNS, count
from ._errors import OpenAIError
from ._keys import ADMIN_ID, MICRO, redis_keys
from ._prices import Price, PriceBook
from ._ratelimit import rate_limit_error
from ._settings import GatewaySettings

log = logging.getLogger(__name__)


def load_script(client: redis.Redis, name: str) -> Any:
    """A Lua script of lua/ as a redis-py Script (EVALSHA, loaded again after a Redis restart)."""
    lua = resources.files(__package__).joinpath("lua")
    return client.register_script(lua.joinpath("_prelude.lua").read_text() + lua.joinpath(name).read_text())


@dataclass(frozen=True, slots=True)
class Caller:
    key_id: str          # ADMIN_ID for the admin key
    key_hash: str = ""   # sha256 of the presented virtual key

    @property
    def admin(self) -> bool:
        return self.key_id == ADMIN_ID


def _unavailable(exc: Exception) -> OpenAIError:
    return OpenAIError(503, f"the governance store (Redis) is unavailable: {type(exc).__name__}",
                       type="service_unavailable", code="governance_unavailable")


def denial(code: str, detail: str, key_id: str, model: str) -> OpenAIError:
    """reserve.lua's refusal in OpenAI's error shape."""
    DENIALS.labels(code).inc()
    no_retry = {"x-should-retry": "false"}
    if code in ("invalid_api_key", "key_revoked", "key_expired"):
        message = {"invalid_api_key": "incorrect API key provided",
                   "key_revoked": f"key {key_id} has been revoked",
                   "key_expired": f"key {key_id} has expired"}[code]
        return OpenAIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer", **no_retry})
    if code == "model_not_allowed":
        allowed = ", ".join(m for m in detail.split(",") if m) or "none"
        return OpenAIError(403, f"key {key_id} may not use model '{model}' (allowed: {allowed})",
                           type="permission_error", code="model_not_allowed", param="model", headers=no_retry)
    if code == "model_not_priced":
        return OpenAIError(403, f"model '{model}' has no price, and key {key_id} has a budget: set one with "
                                f"`exa gateway price set {model} --input-per-mtok USD --output-per-mtok USD`",
                           type="permission_error", code="model_not_priced", param="model", headers=no_retry)
    if code == "budget_exceeded":
        left = max(int(detail or "0"), 0) / MICRO
        return OpenAIError(429, f"budget of key {key_id} exceeded: {left:.6f} USD left, less than this "
                                "request's prompt and one output token cost",
                           type="insufficient_quota", code="budget_exceeded", headers=no_retry)
    return rate_limit_error(code, detail, key_id)


@dataclass(slots=True)
class Ticket:
    """One admitted call, until it is settled."""

    gov: Governor
    caller: Caller
    res_id: str
    model: str
    body: bytes              # the request body for the engine (max_tokens set when bounded)
    price: Price | None
    prompt_bound: int
    max_tokens: int          # per choice; 0: unbounded
    n: int
    reserved_micro: int
    project: str
    started: float
    ttft_s: float = 0.0
    settled: bool = False

    def first_chunk(self) -> None:
        self.ttft_s = time.perf_counter() - self.started

    async def settle(self, status: str, usage: pb.Usage | None, produced: int | None, stream: bool) -> None:
        """Charge the call once. Without the engine's usage: `produced` chunks were forwarded (each at
        least one token), or None for a complete answer of unknown length (charged at its bound)."""
        if self.settled:
            return
        self.settled = True
        await self._settle(status, usage, produced, stream)

    async def _settle(self, status: str, usage: pb.Usage | None, produced: int | None, stream: bool) -> None:
        if usage is not None:
            prompt, completion, estimated = usage.prompt_tokens, usage.completion_tokens, False
        elif produced == 0:
            prompt, completion, estimated = 0, 0, False  # nothing came back: nothing to charge
        else:
            bound = self.max_tokens * self.n if self.max_tokens else 0
            done = bound if produced is None else (min(produced, bound) if bound else produced)
            prompt, completion, estimated = self.prompt_bound, done, True
        cost = cost_micro_usd(prompt, completion, self.price)
        if cost > self.reserved_micro and not self.caller.admin and self.reserved_micro:
            OVERRUNS.labels(self.model).inc()
        gov = self.gov
        args = [self.res_id, cost, prompt, completion, self.caller.key_id, self.model, status,
                round((time.perf_counter() - self.started) * 1000, 2), round(self.ttft_s * 1000, 2),
                int(stream), int(estimated), int(self.price is not None), gov.trim_ms]
        try:
            await gov.settle_script(keys=redis_keys(self.caller.key_id), args=args)
        except redis.RedisError as exc:
            # The reservation stays; the reaper returns it once its lease runs out.
            log.error("cannot settle call of key %s on %s (%s): cost %d micro-USD not recorded",
                      self.caller.key_id, self.model, exc, cost)
            return
        if status != "404":  # an unrouted name is the client's string: not a metric label
            count(self.model, self.project, status, prompt, completion, cost)

    def settle_later(self, status: str, usage: pb.Usage | None, produced: int | None,
                     stream: bool) -> asyncio.Task[None] | None:
        """Settle in a task of its own, which a client going away cannot cancel."""
        if self.settled:
            return None
        self.settled = True
        task = asyncio.get_running_loop().create_task(self._settle(status, usage, produced, stream))
        self.gov.background.add(task)
        task.add_done_callback(self.gov.background.discard)
        return task


@dataclass(slots=True)
class Governor:
    settings: GatewaySettings
    redis: redis.Redis
    prices: PriceBook
    replica_id: str
    reserve_script: Any = None
    settle_script: Any = None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    trim_ms: int = 0
    lease_ms: int = 0

    def __post_init__(self) -> None:
        self.reserve_script = load_script(self.redis, "reserve.lua")
        self.settle_script = load_script(self.redis, "settle.lua")
        s = self.settings
        self.trim_ms = int(s.cost_retention_days * 86_400_000)
        self.lease_ms = int((s.request_timeout_s + s.reservation_grace_s) * 1000)

    async def admit(self, caller: Caller, req: Any, raw: bytes, started: float) -> Ticket:
        model = req.model
        price = self.prices.get(model)
        n = req.n or 1
        if caller.admin:
            return Ticket(self, caller, "", model, raw, price, 0, 0, n, 0, "", started)
        s = self.settings
        prompt = estimate_prompt_tokens(raw, getattr(req, "messages", None), s.prompt_overhead_tokens,
                                        s.media_part_tokens)
        asked = requested_max_tokens(req)
        res_id = secrets.token_hex(8)
        args = [caller.key_hash, model, res_id, self.replica_id, prompt,
                prompt * price.input_micro_per_mtok if price else 0,
                n * price.output_micro_per_mtok if price else 0, n, asked, s.default_max_tokens,
                int(price is not None), self.lease_ms]
        try:
            out = await self.reserve_script(keys=redis_keys(caller.key_id)[:2], args=args)
        except redis.RedisError as exc:
            raise _unavailable(exc) from None
        if out[0] != "ok":
            raise denial(out[1], out[2], caller.key_id, model)
        max_tokens, reserved, project, bounded = int(out[1]), int(out[2]), out[4], out[5] == "1"
        body = raw
        if bounded and (asked == 0 or max_tokens < asked):
            body = with_max_tokens(raw, max_tokens)
        return Ticket(self, caller, res_id, model, body, price, prompt, max_tokens if bounded else asked, n,
                      reserved, project, started)
