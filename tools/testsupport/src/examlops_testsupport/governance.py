"""Governance under load, shared by the single-Redis and the Redis Cluster tests: issue a virtual key,
fire a burst of calls with the official openai client, drain a limit, read the key's Redis records.

Every call goes to the model `conc-a` (register it with the echo engine and a price).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, wait_until

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
REQUESTS = 200
#: Gateway settings for these tests: prices within 0.2 s, a dead replica noticed within a second.
FAST = {"EXAMLOPS_PRICE_REFRESH_S": "0.2", "EXAMLOPS_HEARTBEAT_S": "0.2", "EXAMLOPS_REPLICA_TTL_S": "1",
        "EXAMLOPS_REAPER_INTERVAL_S": "0.5"}
Outcome = tuple[str, int, int, Any]  # (ok or the refusal's code, prompt tokens, completion tokens, error)


def routes_and_prices_synced(url: str, models: tuple[str, ...] = ("conc-a", "slow")) -> bool:
    """The gateway at `url` routes and prices every one of `models`."""
    routed = {m["id"] for m in httpx.get(url + "/v1/models", headers=ADMIN).json()["data"]}
    priced = {p["model"] for p in httpx.get(url + "/admin/prices", headers=ADMIN).json()["data"]}
    return set(models) <= routed and set(models) <= priced


def issue(url: str, models: tuple[str, ...] = ("conc-a", "slow"), **limits: Any) -> dict[str, Any]:
    """A new virtual key of tenant `load`, project `conc` (its row: id, virtual_key, limits)."""
    resp = httpx.post(url + "/admin/keys", headers=ADMIN,
                      json={"tenant": "load", "project": "conc", "models": list(models), **limits})
    assert resp.status_code == 201, resp.text
    row: dict[str, Any] = resp.json()
    return row


def key_hash(stack: Stack, key_id: str) -> dict[str, str]:
    with stack.redis_client() as r:
        return r.hgetall("{vk:" + key_id + "}:key")  # type: ignore[return-value]


def open_reservations(stack: Stack, key_id: str) -> list[str]:
    with stack.redis_client() as r:
        return [f for f in r.hkeys("{vk:" + key_id + "}:res") if not f.startswith("reaped:")]  # type: ignore[union-attr]


def cost_records(stack: Stack, key_id: str) -> list[dict[str, str]]:
    with stack.redis_client() as r:
        return [f for _id, f in r.xrange("{vk:" + key_id + "}:cost")]  # type: ignore[union-attr]


async def one_call(c: openai.AsyncOpenAI, i: int) -> Outcome:
    """One call in one of three shapes (whole, streamed with usage, streamed without)."""
    messages = [{"role": "user", "content": f"c{i} alpha beta gamma"}]
    shape = i % 3
    try:
        if shape == 0:
            resp = await c.chat.completions.create(model="conc-a", messages=messages, max_tokens=8)  # type: ignore[arg-type]
            return "ok", resp.usage.prompt_tokens, resp.usage.completion_tokens, None  # type: ignore[union-attr]
        stream = await c.chat.completions.create(
            model="conc-a", messages=messages, max_tokens=8, stream=True,  # type: ignore[arg-type]
            **({"stream_options": {"include_usage": True}} if shape == 1 else {}))
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        if usage is not None:
            return "ok", usage.prompt_tokens, usage.completion_tokens, None
        return "ok", 4, len(text.split()), None  # the echo engine: one word per token
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return str(body.get("code")), 0, 0, exc


def burst(urls: list[str], key: str, n: int = REQUESTS) -> tuple[list[Outcome], float]:
    """n calls at once, alternating between the replicas; returns the outcomes and the seconds taken."""
    async def run() -> list[Outcome]:
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=key, max_retries=0, timeout=60) for u in urls]
        try:
            return list(await asyncio.gather(*[one_call(clients[i % len(clients)], i) for i in range(n)]))
        finally:
            for c in clients:
                await c.close()

    start = time.monotonic()
    out = asyncio.run(run())
    return out, time.monotonic() - start


def drain(urls: list[str], key: str, refusal: str) -> list[tuple[int, int]]:
    """Calls one at a time, alternating replicas, until one is refused with `refusal`; their usage."""
    clients = [openai.OpenAI(base_url=u + "/v1", api_key=key, max_retries=0) for u in urls]
    used: list[tuple[int, int]] = []
    try:
        for i in range(10_000):
            try:
                resp = clients[i % len(clients)].chat.completions.create(
                    model="conc-a", max_tokens=8, messages=[{"role": "user", "content": f"d{i} alpha beta gamma"}])
            except openai.RateLimitError as exc:
                assert isinstance(exc.body, dict) and exc.body["code"] == refusal
                return used
            assert resp.usage is not None
            used.append((resp.usage.prompt_tokens, resp.usage.completion_tokens))
    finally:
        for c in clients:
            c.close()
    raise AssertionError("never refused")


def check_budget_never_overspent(stack: Stack, urls: list[str]) -> None:
    """REQUESTS concurrent calls over `urls` on a 2000 micro-USD budget, then calls one at a time until
    refused: spend never passes the budget (zero overshoot) and every record adds up exactly."""
    budget_micro = 2000
    row = issue(urls[0], budget_usd=budget_micro / 1e6)
    results, _ = burst(urls, row["virtual_key"])
    codes = {r[0] for r in results}
    assert codes <= {"ok", "budget_exceeded"}, [r[3] for r in results if r[0] not in ("ok", "budget_exceeded")][:3]
    ok = [r for r in results if r[0] == "ok"]
    assert ok and len(ok) < REQUESTS  # some were served, the rest refused
    # then spend the rest, one call at a time, until the budget says no
    drain(urls, row["virtual_key"], "budget_exceeded")

    wait_until(lambda: not open_reservations(stack, row["id"]), 5)
    f = key_hash(stack, row["id"])
    spent = int(f["spent"])
    assert spent <= budget_micro  # zero overshoot
    assert spent > budget_micro - 400  # ... and the budget was used, not just refused (a reservation < 400)
    assert f["reserved"] == "0" and open_reservations(stack, row["id"]) == []
    records = cost_records(stack, row["id"])
    assert sum(int(r["cost_micro_usd"]) for r in records) == spent  # exactly
    served = [r for r in records if r["status"] == "200"]
    assert len(served) == int(f["requests"]) >= len(ok)
    # every served call of the burst was billed what its usage says: 1 micro-USD a prompt token, 2 a completion one
    burst_cost = sum(p + 2 * c for _, p, c, _ in ok)
    assert burst_cost <= spent
    assert {r["stream"] for r in served} == {"0", "1"}


def check_rpm_holds(stack: Stack, urls: list[str], rpm: int = 20) -> None:
    """A burst on a key limited to `rpm` requests a minute: a burst of rpm, then rpm per minute (GCRA)."""
    row = issue(urls[0], rpm=rpm)
    results, elapsed = burst(urls, row["virtual_key"])
    ok = [r for r in results if r[0] == "ok"]
    limited = [r for r in results if r[0] == "rate_limit_exceeded"]
    assert len(ok) + len(limited) == REQUESTS, {r[0]: str(r[3])[:300] for r in results}
    assert rpm <= len(ok) <= rpm + int(elapsed * rpm / 60) + 1
    assert all(int(r[3].response.headers["retry-after"]) >= 1 for r in limited)
    wait_until(lambda: not open_reservations(stack, row["id"]), 5)
    assert int(key_hash(stack, row["id"])["requests"]) == len(ok)


def check_tpm_holds(stack: Stack, urls: list[str], tpm: int = 2000) -> None:
    """A burst, then calls one at a time, on a key limited to `tpm` tokens a minute: the real tokens
    admitted fit the bucket and its refill, and the key's counters say exactly that."""
    row = issue(urls[0], tpm=tpm)
    start = time.monotonic()
    results, _ = burst(urls, row["virtual_key"])
    ok = [r for r in results if r[0] == "ok"]
    limited = [r for r in results if r[0] == "rate_limit_exceeded"]
    assert ok and limited and len(ok) + len(limited) == REQUESTS
    # Reservations are bounds (prompt bytes + max_tokens), so the burst is limited by them; calls one
    # at a time give their unused tokens back and fill the bucket with real tokens until it says no.
    ok += [("ok", p, c, None) for p, c in drain(urls, row["virtual_key"], "rate_limit_exceeded")]
    elapsed = time.monotonic() - start
    used = sum(p + c for _, p, c, _ in ok)
    assert tpm / 2 < used <= tpm + elapsed * tpm / 60
    wait_until(lambda: not open_reservations(stack, row["id"]), 5)
    f = key_hash(stack, row["id"])
    assert int(f["prompt_tokens"]) + int(f["completion_tokens"]) == used
