"""Cost records: the per-call stream the scripts append to (append_cost in lua/_prelude.lua), its
Prometheus counters, and the spend summary.

A record (one per call, in `{vk:<id>}:cost`) carries model, key, tenant, project, prompt_tokens,
completion_tokens, cost_micro_usd, latency_ms, ttft_ms, status (HTTP status; 499 when the client
went away; `reaped`), stream, estimated (usage not reported by the engine), priced, late, guarded
(what the guardrails did), cache (what the response cache did: hit-exact and hit-semantic cost
nothing; miss, bypass; empty when no cache policy applied), provider (the cost provider that priced
it: prices, gpu-hour, module:Class; empty on a reaped record), basis (how: gpu-hour's GPUs and
throughputs; empty for prices) and clamped (micro-USD a clamping provider asked above the
reservation and was not charged).
Because settle.lua adds to the key's `spent` and appends the record in one script, the key's spend
is always the sum of its records' costs (within EXAMLOPS_COST_RETENTION_DAYS).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import redis.asyncio as redis
from prometheus_client import Counter

from .._metrics import child
from ._keys import ADMIN_ID, redis_keys
from ._prices import MICRO

CALLS = Counter("examlops_gateway_calls_total", "Settled calls, by model, project and status.",
                ["model", "project", "status"])
TOKENS = Counter("examlops_gateway_tokens_total", "Billed tokens, by model, project and type (prompt, completion).",
                 ["model", "project", "type"])
COST = Counter("examlops_gateway_cost_usd_total", "Billed cost in USD, by model and project.", ["model", "project"])
DENIALS = Counter("examlops_gateway_denials_total", "Requests refused by keys, budgets and limits, by reason.",
                  ["reason"])
OVERRUNS = Counter("examlops_gateway_reservation_overruns_total",
                   "Calls whose real cost exceeded their reservation (the prompt bound failed).", ["model"])
REAPED = Counter("examlops_gateway_reservations_reaped_total", "Reservations returned by this replica's reaper.")

GROUPS = ("key", "project", "model", "tenant", "provider")


def count(model: str, project: str, status: str, prompt: int, completion: int, cost_micro: int) -> None:
    child(CALLS, model, project, status).inc()
    if prompt:
        child(TOKENS, model, project, "prompt").inc(prompt)
    if completion:
        child(TOKENS, model, project, "completion").inc(completion)
    if cost_micro:
        child(COST, model, project).inc(cost_micro / MICRO)


async def records(r: redis.Redis, key_id: str, since_ms: int = 0, page: int = 2000) -> AsyncIterator[dict[str, str]]:
    """One key's cost records, oldest first."""
    stream = redis_keys(key_id)[2]
    start = f"{since_ms}-0" if since_ms else "-"
    while True:
        batch = cast(list[tuple[str, dict[str, str]]], await r.xrange(stream, min=start, count=page))
        for entry_id, fields in batch:
            yield {"id": entry_id, **fields}
        if len(batch) < page:
            return
        start = "(" + batch[-1][0]


async def spend_summary(r: redis.Redis, key_ids: list[str], group_by: str, since_ms: int = 0) -> list[dict[str, Any]]:
    """Requests, tokens and cost per group, summed from the cost records of `key_ids` and the admin key."""
    groups: dict[str, dict[str, Any]] = {}
    for key_id in [*key_ids, ADMIN_ID]:
        async for rec in records(r, key_id, since_ms):
            name = rec.get(group_by, "")
            g = groups.setdefault(name, {group_by: name, "requests": 0, "errors": 0, "prompt_tokens": 0,
                                         "completion_tokens": 0, "cost_micro_usd": 0, "unpriced": 0,
                                         "clamped_micro_usd": 0})
            g["requests"] += 1
            g["errors"] += rec.get("status") != "200"
            g["prompt_tokens"] += int(rec.get("prompt_tokens", 0))
            g["completion_tokens"] += int(rec.get("completion_tokens", 0))
            g["cost_micro_usd"] += int(rec.get("cost_micro_usd", 0))
            g["unpriced"] += rec.get("priced") == "0"
            g["clamped_micro_usd"] += int(rec.get("clamped") or 0)
    rows = sorted(groups.values(), key=lambda g: (-g["cost_micro_usd"], str(g[group_by])))
    for g in rows:
        g["cost"] = g["cost_micro_usd"] / MICRO
    return rows
