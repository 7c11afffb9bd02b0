"""Governance on the request path: one Redis round trip to admit a call, one to settle it.

Governor.admit(): reserve.lua checks the virtual key (check_key), the allow-list, the budget and the
rate limits and reserves, atomically. The admin key skips it (every model, no budget, no limit).
Ticket.settle(): settle.lua charges the real cost and appends the cost record, exactly once per
call, whether the call ends normally, fails in the engine or loses its client; a settle Redis does
not answer is retried in the background while the process lives (settle.lua is idempotent per
reservation). Ticket.note_progress(): a long stream notes what it delivered in its reservation
(progress.lua), which the reaper charges if this replica dies before settling.
Governor.allowed_models(): key_models.lua, the same key check on the same clock, for /v1/models.
What a call costs, and what its reservation bounds, is the cost provider's (_provider.py), resolved
once per process from EXAMLOPS_LLM_COST_PROVIDER.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as redis

from examlops.svc import RouteTable

from .._settings import GatewaySettings
from ._budget import Generation, estimate_prompt_tokens, with_max_tokens
from ._cost import OVERRUNS, count
from ._durability import UNMATCHED, SettleJournal, StoreWatch
from ._errors import GovernanceUnavailable
from ._keys import ADMIN_ID, redis_keys
from ._pipe import ScriptPipe, scripts_for
from ._prices import MICRO, Price, PriceBook, Rates
from ._provider import Spent, gpus_of, resolve
from ._scripts import Admission, ProgressArgs, ReserveArgs, SettleArgs, allowed_models
from ._throughput import Throughput

log = logging.getLogger(__name__)

SETTLE_RETRY_FIRST_S = 0.05   # a settle Redis did not answer is retried after this, doubling ...
SETTLE_RETRY_MAX_S = 2.0      # ... up to this, while the process lives


class Usage(Protocol):
    """The engine's token counts (engine-proxy's Usage message)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Caller:
    key_id: str          # ADMIN_ID for the admin key
    key_hash: str = ""   # sha256 of the presented virtual key

    @property
    def admin(self) -> bool:
        return self.key_id == ADMIN_ID


@dataclass(slots=True)
class Ticket:
    """One admitted call, until it is settled."""

    gov: Governor
    caller: Caller
    res_id: str              # '' for the admin key, which reserves nothing
    model: str
    body: bytes              # the request body for the engine (max_tokens set when bounded)
    stream: bool
    price: Price | None      # the registry's entry, as at admission
    prompt_bound: int
    max_tokens: int          # per choice; 0: unbounded
    n: int
    reserved_micro: int
    project: str
    started: float
    ttft_s: float = 0.0
    settled: bool = False
    guardrails: tuple[str, ...] = ()   # the key's guardrail policies (guardrails/ adds the endpoint's)
    guarded: str = ""                  # what the guardrails did (their header's value), for the cost record
    tenant: str = ""                   # the key's tenant ('' for the admin key): the cache's scopes
    cache: str = ""                    # what the response cache did (hit-exact, hit-semantic, miss, bypass)
    budgeted: bool = False             # the key has a budget: a clamping provider's cost stops at the reservation
    replica: str = ""                  # the replica that answered (engine-proxy's first message)
    cost_usd: float | None = None      # the cost written into the cost record, once the call settles
    rates: Rates | None = None         # the provider's per-token bound the reservation was built from (None: unpriced)
    gpus: int = 0                      # GPUs of one server, as at admission (0: the provider does not use them)

    def first_chunk(self) -> None:
        self.ttft_s = time.perf_counter() - self.started

    async def settle(self, status: str, usage: Usage | None = None, delivered: int | None = 0) -> None:
        """Charge the call once: the engine's `usage` (on a cut stream, what it reported delivered so
        far) plus `delivered`, an upper bound of the completion tokens sent beyond that usage (0: none).
        Without usage: `delivered` 0 means nothing came back (nothing to charge), None a complete answer
        of unknown length (charged at its bound)."""
        if self.settled:
            return
        self.settled = True
        await self._settle(status, usage, delivered)

    def settle_later(self, status: str, usage: Usage | None = None,
                     delivered: int | None = 0) -> asyncio.Task[None] | None:
        """Settle in a task of its own, which a client going away cannot cancel."""
        if self.settled:
            return None
        self.settled = True
        return self._in_background(self._settle(status, usage, delivered))

    def note_progress(self, usage: Usage | None, delivered: int) -> None:
        """Write what this open call has delivered so far into its reservation (progress.lua, in the
        background), so the reaper charges it if this replica dies or cannot settle."""
        if not self.res_id or self.settled:
            return
        prompt, completion, estimated = self._charge(usage, delivered)
        tps = self.gov.throughput.last.get((self.model, self.replica), 0.0) if self.gov.throughput else 0.0
        cost, _ = self._cost(prompt, completion, Spent(time.perf_counter() - self.started, tps, "200", estimated))
        args = ProgressArgs(self.res_id, cost, prompt, completion)
        self._in_background(self._note(args))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.gov.background.add(task)
        task.add_done_callback(self.gov.background.discard)
        return task

    async def _note(self, args: ProgressArgs) -> None:
        try:
            await self.gov.progress_script(keys=redis_keys(self.caller.key_id)[1:2], args=args.argv())
        except redis.RedisError as exc:  # the settle will charge it; the note only helps the reaper
            log.debug("cannot note the progress of a call of key %s: %s", self.caller.key_id, exc)

    def _charge(self, usage: Usage | None, delivered: int | None) -> tuple[int, int, bool]:
        """(prompt tokens, completion tokens, estimated): never less than what was delivered, never more
        completion tokens by estimate than the engine was allowed to make (max_tokens x n)."""
        bound = self.max_tokens * self.n if self.max_tokens else 0
        if usage is None:
            if delivered == 0:
                return 0, 0, False  # nothing came back: nothing to charge
            done = bound if delivered is None else (min(delivered, bound) if bound else delivered)
            return self.prompt_bound, done, True
        extra = delivered or 0
        if extra and bound:
            extra = min(extra, max(0, bound - usage.completion_tokens))
        return usage.prompt_tokens, usage.completion_tokens + extra, extra > 0

    def _cost(self, prompt: int, completion: int, spent: Spent) -> tuple[int, str]:
        """The provider's cost in micro-USD and its basis; nothing made costs nothing."""
        if not prompt and not completion:
            return 0, ""
        return self.gov.costing.charge(self, prompt, completion, spent)

    async def _settle(self, status: str, usage: Usage | None, delivered: int | None) -> None:
        prompt, completion, estimated = self._charge(usage, delivered)
        latency_ms = round((time.perf_counter() - self.started) * 1000, 2)
        tps = 0.0
        if self.gov.throughput is not None and (prompt or completion):
            tps = await self.gov.throughput.observe(self.model, self.replica, prompt + completion, latency_ms / 1000)
        cost, basis = self._cost(prompt, completion, Spent(latency_ms / 1000, tps, status, estimated))
        clamped = 0
        if cost > self.reserved_micro and not self.caller.admin and (self.reserved_micro or self.budgeted):
            OVERRUNS.labels(self.model).inc()
            if self.gov.costing.clamps and self.budgeted:  # a budget's guarantee: never past the reservation
                cost, clamped = self.reserved_micro, cost - self.reserved_micro
        self.cost_usd = cost / MICRO
        args = SettleArgs(
            res_id=self.res_id, cost_micro=cost, prompt_tokens=prompt, completion_tokens=completion,
            key_id=self.caller.key_id, model=self.model, status=status,
            latency_ms=latency_ms, ttft_ms=round(self.ttft_s * 1000, 2),
            stream=self.stream, estimated=estimated, priced=self.rates is not None, trim_ms=self.gov.trim_ms,
            guarded=self.guarded, cache=self.cache, provider=self.gov.costing.name, basis=basis, clamped=clamped)
        if not await self._record(args, retrying=False):
            # Retried while this process lives (settle.lua answers "duplicate" to a repeat); if it dies
            # first, the reaper charges the last progress note.
            self._in_background(self._record_until_done(args))

    async def _record_until_done(self, args: SettleArgs) -> None:
        delay = SETTLE_RETRY_FIRST_S
        while True:
            await asyncio.sleep(delay)
            if await self._record(args, retrying=True):
                return
            delay = min(delay * 2, SETTLE_RETRY_MAX_S)

    async def _record(self, args: SettleArgs, retrying: bool) -> bool:
        """One settle.lua call; False when Redis did not answer. An acknowledged settle of a reservation
        is journaled, to be sent again if the store restarts and loses it (_durability.py)."""
        keys, argv = redis_keys(self.caller.key_id), args.argv()
        try:
            reply = await self.gov.settle_script(keys=keys, args=argv)
        except redis.RedisError as exc:
            if not retrying:
                log.warning("cannot settle a call of key %s on %s yet (%s): cost %d micro-USD, retrying",
                            self.caller.key_id, self.model, exc, args.cost_micro)
            return False
        if retrying:
            log.info("settled a call of key %s on %s after retrying", self.caller.key_id, self.model)
        if args.res_id and reply[0] == "ok":
            self.gov.journal.add(keys, argv)
        elif args.res_id:  # duplicate: landed before (its reply was lost), or the reservation was lost
            UNMATCHED.labels("retry" if retrying else "first").inc()
            if not retrying:
                log.warning("a call of key %s on %s found no reservation to settle (lost in a governance store "
                            "restart?): cost %d micro-USD not charged", self.caller.key_id, self.model,
                            args.cost_micro)
        if reply[0] == "ok" and args.status != "404":  # an unrouted name is the client's string: no label
            count(self.model, self.project, args.status, args.prompt_tokens, args.completion_tokens,
                  args.cost_micro)
        return True


class Governor:
    """Admission and settlement of calls, for one gateway replica."""

    def __init__(self, settings: GatewaySettings, client: redis.Redis, prices: PriceBook, replica_id: str,
                 routes: RouteTable | None = None, pipe: ScriptPipe | None = None) -> None:
        """`pipe`: the scripts' connection (_pipe.py); None sends them through `client`."""
        self.settings, self.redis, self.prices, self.replica_id = settings, client, prices, replica_id
        self.routes = routes if routes is not None else RouteTable.empty()
        self.costing = resolve(settings.llm_cost_provider)  # checked when the settings were read
        self.throughput = Throughput(client, settings.cost_window_s) if self.costing.uses_throughput else None
        self.trim_ms = int(settings.cost_retention_days * 86_400_000)
        self.lease_ms = int((settings.request_timeout_s + settings.reservation_grace_s) * 1000)
        self.reserve_script = scripts_for(pipe, client, "reserve.lua")
        self.settle_script = scripts_for(pipe, client, "settle.lua")
        self.progress_script = scripts_for(pipe, client, "progress.lua")
        self.key_models_script = scripts_for(pipe, client, "key_models.lua")
        self.background: set[asyncio.Task[None]] = set()
        self.journal = SettleJournal()
        self.watch = StoreWatch(client, self.journal, self._resettle)

    async def _resettle(self, keys: list[str], argv: list[Any]) -> Any:
        return await self.settle_script(keys=keys, args=argv)

    async def admit(self, caller: Caller, req: Generation, raw: bytes, started: float) -> Ticket:
        """Reserve the call's maximum cost and rate-limit room; raises Denied or GovernanceUnavailable."""
        model = req.model
        price = self.prices.get(model)
        costing = self.costing
        gpus = gpus_of(self.routes.get(model), price) if costing.uses_gpus else 0
        rates = costing.rates(price, gpus, model, caller.key_id)
        n = req.choices
        if caller.admin:
            return Ticket(gov=self, caller=caller, res_id="", model=model, body=raw, stream=req.stream, price=price,
                          rates=rates, gpus=gpus, prompt_bound=0, max_tokens=0, n=n, reserved_micro=0, project="",
                          started=started)
        s = self.settings
        prompt = estimate_prompt_tokens(raw, getattr(req, "messages", None), s.prompt_overhead_tokens,
                                        s.media_part_tokens)
        asked = req.output_limit
        args = ReserveArgs(
            key_hash=caller.key_hash, model=model, res_id=secrets.token_hex(8), replica_id=self.replica_id,
            prompt_tokens=prompt, prompt_cost=prompt * rates.input_micro_per_mtok if rates else 0,
            output_rate=n * rates.output_micro_per_mtok if rates else 0, n=n, max_tokens_asked=asked,
            default_max_tokens=s.default_max_tokens, priced=rates is not None, lease_ms=self.lease_ms)
        try:
            reply = await self.reserve_script(keys=redis_keys(caller.key_id)[:2], args=args.argv())
        except redis.RedisError as exc:
            raise GovernanceUnavailable(exc) from None
        adm = Admission.from_reply(reply, caller.key_id, model)
        body = raw
        if adm.bounded and n and (not req.output_limit_sent or adm.max_tokens < asked):  # n 0: no output
            body = with_max_tokens(raw, adm.max_tokens)
        return Ticket(gov=self, caller=caller, res_id=args.res_id, model=model, body=body, stream=req.stream,
                      price=price, rates=rates, gpus=gpus, prompt_bound=prompt,
                      max_tokens=adm.max_tokens if adm.bounded else asked, n=n,
                      reserved_micro=adm.reserved_micro, project=adm.project, tenant=adm.tenant, started=started,
                      guardrails=adm.guardrails, budgeted=adm.budgeted)

    def admin_ticket(self, route: str, body: bytes, started: float, guarded: str = "") -> Ticket:
        """A call the gateway makes for itself (a guardrail judge), on the admin key's record."""
        price = self.prices.get(route)
        gpus = gpus_of(self.routes.get(route), price) if self.costing.uses_gpus else 0
        return Ticket(gov=self, caller=Caller(ADMIN_ID), res_id="", model=route, body=body, stream=False,
                      price=price, rates=self.costing.rates(price, gpus, route, ADMIN_ID), gpus=gpus, prompt_bound=0,
                      max_tokens=0, n=1, reserved_micro=0, project="", started=started, guarded=guarded)

    async def allowed_models(self, caller: Caller) -> set[str] | None:
        """None for the admin key; a virtual key's allow-list once the key checks out (else Denied)."""
        if caller.admin:
            return None
        try:
            reply = await self.key_models_script(keys=redis_keys(caller.key_id)[:1], args=[caller.key_hash])
        except redis.RedisError as exc:
            raise GovernanceUnavailable(exc) from None
        return allowed_models(reply, caller.key_id)
