"""The swappable cost provider (EXAMLOPS_LLM_COST_PROVIDER; services/gateway/GOVERNANCE.md, "Cost providers").

Each provider runs in a gateway replica of the session stack (same Redis, registry and engine-proxy),
called with the official openai client on echo endpoints; the cost records, the key's spend and
`exa gateway spend` are read back and checked against the provider's documented arithmetic.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops_devstack import service_argv
from examlops_gateway._settings import GatewaySettings
from examlops_gateway.governance import Governor, Price, PriceBook
from examlops_testsupport import cost_providers
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.governance import (
    cost_records,
    issue,
    key_hash,
    open_reservations,
    routes_and_prices_synced,
)

GPU_HOUR_USD, MIN_TPS, TP = 3.6, 10.0, 2   # 2 GPUs x 3.6 USD/h: 2,000 micro-USD per second
BOUND_PER_TOKEN = math.ceil(GPU_HOUR_USD * 1e6 * TP / (3600 * MIN_TPS))  # micro-USD: what a token reserves
PROVIDER = "EXAMLOPS_LLM_COST_PROVIDER"
CUSTOM = "examlops_testsupport.cost_providers:PerCallFee"


@pytest.fixture(scope="module")
def gateways(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A replica per provider, the endpoints `cost-tok` (per-token price) and `cost-gpu` (tensor
    parallel 2, a GPU-hour price and a per-token one), and the custom provider's log."""
    log = tmp_path_factory.mktemp("cost") / "calls.jsonl"
    block = json.dumps({"engine": "echo", "tensor_parallel_size": TP})
    stack.register("cost-tok", engine="echo")
    stack.register("cost-gpu", engine="echo", engine_block_json=block)
    for args in (["cost-tok", "--input-per-mtok", "1", "--output-per-mtok", "2"],
                 ["cost-gpu", "--input-per-mtok", "1", "--output-per-mtok", "2", "--gpu-hour", str(GPU_HOUR_USD),
                  "--min-tokens-per-s", str(MIN_TPS)]):
        out = stack.cli("gateway", "price", "set", *args)
        assert out.returncode == 0, out.stderr
    urls = {"prices": stack.gateway_url}
    names = {"gpu-hour": "gw-gpu-hour", CUSTOM: "gw-custom"}
    for provider, name in names.items():
        urls[provider] = stack.start_gateway_replica(name, {PROVIDER: provider, "EXAMLOPS_TEST_COST_LOG": str(log)})[1]
    for url in urls.values():
        wait_until(lambda u=url: _routed(u), 10)
    yield {"urls": urls, "log": log}
    for name in names.values():
        stack.stop(name)


def _routed(url: str) -> bool:
    return routes_and_prices_synced(url, ("cost-tok", "cost-gpu"))


def _calls(url: str, key: str, model: str, n: int, concurrency: int = 1) -> list[str]:
    """n calls (whole and streamed with usage alternating), `concurrency` at a time; 'ok' or the refusal."""
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        messages = [{"role": "user", "content": f"call {i} alpha beta gamma delta"}]
        try:
            if i % 2:
                stream = await c.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                         stream=True, stream_options={"include_usage": True})
                async for _ in stream:
                    pass
            else:
                await c.chat.completions.create(model=model, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        except openai.APIStatusError as exc:
            return str(exc.body.get("code") if isinstance(exc.body, dict) else exc.status_code)
        return "ok"

    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        sem = asyncio.Semaphore(concurrency)

        async def limited(i: int) -> str:
            async with sem:
                return await one(c, i)
        try:
            return list(await asyncio.gather(*[limited(i) for i in range(n)]))
        finally:
            await c.close()
    return asyncio.run(run())


def _settled(stack: Stack, key_id: str, n: int) -> list[dict[str, str]]:
    wait_until(lambda: len(cost_records(stack, key_id)) >= n and not open_reservations(stack, key_id), 10)
    return cost_records(stack, key_id)


def _budget_holds(stack: Stack, key_id: str, budget_micro: int) -> list[dict[str, str]]:
    """Spend never passed the budget, nothing is left reserved, and the records add up to the spend."""
    wait_until(lambda: not open_reservations(stack, key_id), 10)
    f = key_hash(stack, key_id)
    records = cost_records(stack, key_id)
    assert int(f["spent"]) <= budget_micro and f["reserved"] == "0"
    assert sum(int(r["cost_micro_usd"]) for r in records) == int(f["spent"])
    return records


def test_prices_is_the_default_and_unchanged(stack: Stack, gateways: dict[str, Any]) -> None:
    row = issue(stack.gateway_url, ("cost-tok",))
    assert set(_calls(stack.gateway_url, row["virtual_key"], "cost-tok", 4)) == {"ok"}
    records = _settled(stack, row["id"], 4)
    for r in records:  # 1 USD per Mtok prompt, 2 completion: 1 and 2 micro-USD a token
        assert r["provider"] == "prices" and r["basis"] == "" and r["clamped"] == "0"
        assert int(r["cost_micro_usd"]) == int(r["prompt_tokens"]) + 2 * int(r["completion_tokens"]) > 0


def _check_gpu_hour(r: dict[str, str]) -> float:
    """The record's cost is the documented formula of its own numbers; returns the billed tokens/s."""
    basis = dict(part.split("=") for part in r["basis"].split(";"))
    tokens = int(r["prompt_tokens"]) + int(r["completion_tokens"])
    own = tokens / (float(r["latency_ms"]) / 1000)
    server, billed = float(basis["server_tokens_per_s"]), float(basis["billed_tokens_per_s"])
    assert int(basis["gpus"]) == TP
    assert billed == pytest.approx(max(server, MIN_TPS, own), rel=1e-4)
    want = GPU_HOUR_USD * 1e6 * TP * tokens / billed / 3600
    assert abs(int(r["cost_micro_usd"]) - math.ceil(want)) <= 1, (r, want)
    assert int(r["cost_micro_usd"]) <= tokens * BOUND_PER_TOKEN  # never past what the reservation bounded
    return billed


def test_gpu_hour_cost_is_the_call_share_of_the_gpu_time(stack: Stack, gateways: dict[str, Any]) -> None:
    url = gateways["urls"]["gpu-hour"]
    row = issue(url, ("cost-gpu", "cost-tok"))
    # a lone call on an idle server: charged its whole GPU time (2 GPUs for its duration)
    assert _calls(url, row["virtual_key"], "cost-gpu", 1) == ["ok"]
    lone = _settled(stack, row["id"], 1)[0]
    assert lone["provider"] == "gpu-hour"
    _check_gpu_hour(lone)
    assert int(lone["cost_micro_usd"]) == pytest.approx(2000 * float(lone["latency_ms"]) / 1000, abs=1.01)
    # concurrent calls share the server: each is charged its share of the busy seconds' throughput
    start = time.monotonic()
    assert set(_calls(url, row["virtual_key"], "cost-gpu", 24, concurrency=8)) == {"ok"}
    wall = time.monotonic() - start
    records = _settled(stack, row["id"], 25)
    billed = [_check_gpu_hour(r) for r in records]
    servers = [float(dict(p.split("=") for p in r["basis"].split(";"))["server_tokens_per_s"]) for r in records]
    assert max(servers) > 0 and len(billed) == 25
    gpu_s = sum(int(r["cost_micro_usd"]) for r in records[1:]) / 2000 * TP
    print(f"\n24 calls, 8 at a time, in {wall * 1000:.0f} ms: charged {gpu_s * 1000:.0f} GPU-ms "
          f"({TP} GPUs x {wall * 1000:.0f} ms = {TP * wall * 1000:.0f}); server tokens/s seen "
          f"{min(servers):.0f}..{max(servers):.0f}")
    # an endpoint with only a per-token price is unpriced under gpu-hour: free for an unbudgeted key
    assert _calls(url, row["virtual_key"], "cost-tok", 1) == ["ok"]
    tok = [r for r in _settled(stack, row["id"], 26) if r["model"] == "cost-tok"]
    assert [(r["priced"], r["cost_micro_usd"]) for r in tok] == [("0", "0")]


def test_gpu_hour_budget_reserves_the_bound_and_holds(stack: Stack, gateways: dict[str, Any]) -> None:
    url = gateways["urls"]["gpu-hour"]
    budget_micro = 100_000  # a call reserves ~200 tokens x 200 micro-USD: a few fit at once
    row = issue(url, ("cost-gpu",), budget_usd=budget_micro / 1e6)
    outcomes = _calls(url, row["virtual_key"], "cost-gpu", 30, concurrency=10)
    assert set(outcomes) <= {"ok", "budget_exceeded"} and "ok" in outcomes
    records = _budget_holds(stack, row["id"], budget_micro)
    assert all(r["provider"] == "gpu-hour" and r["clamped"] == "0" for r in records)
    for r in records:
        _check_gpu_hour(r)


def test_custom_provider_prices_calls_and_sees_the_call(stack: Stack, gateways: dict[str, Any]) -> None:
    url, log = gateways["urls"][CUSTOM], gateways["log"]
    row = issue(url, ("cost-gpu",))  # unbudgeted: nothing to clamp
    assert set(_calls(url, row["virtual_key"], "cost-gpu", 4)) == {"ok"}
    records = _settled(stack, row["id"], 4)
    for r in records:
        tokens = int(r["prompt_tokens"]) + int(r["completion_tokens"])
        assert r["provider"] == CUSTOM and r["clamped"] == "0"
        assert int(r["cost_micro_usd"]) == round((cost_providers.FEE_USD + tokens * cost_providers.PER_TOKEN_USD) * 1e6)
    seen = [json.loads(line) for line in Path(log).read_text().splitlines()]
    mine = [c for c in seen if c["key_id"] == row["id"]]
    assert len(mine) == 4
    for c in mine:
        assert (c["endpoint"], c["project"], c["gpus"], c["status"]) == ("cost-gpu", "conc", TP, "200")
        assert c["replica"] and c["duration_s"] > 0 and c["completion_tokens"] > 0
    assert sorted(c["prompt_tokens"] + c["completion_tokens"] for c in mine) == sorted(
        int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in records)


def test_custom_provider_is_clamped_to_the_reservation(stack: Stack, gateways: dict[str, Any]) -> None:
    url = gateways["urls"][CUSTOM]
    budget_micro = 2000  # a call reserves ~200 micro-USD at the per-token price; the fee alone is 500
    row = issue(url, ("cost-gpu",), budget_usd=budget_micro / 1e6)
    outcomes = _calls(url, row["virtual_key"], "cost-gpu", 20, concurrency=4)
    assert set(outcomes) <= {"ok", "budget_exceeded"} and "budget_exceeded" in outcomes
    records = _budget_holds(stack, row["id"], budget_micro)
    served = [r for r in records if r["status"] == "200"]
    assert served and all(int(r["clamped"]) > 0 for r in served)
    for r in served:  # what was charged plus what was clamped is what the provider asked
        tokens = int(r["prompt_tokens"]) + int(r["completion_tokens"])
        asked = round((cost_providers.FEE_USD + tokens * cost_providers.PER_TOKEN_USD) * 1e6)
        assert int(r["cost_micro_usd"]) + int(r["clamped"]) == asked


def test_spend_report_agrees_with_the_records(stack: Stack, gateways: dict[str, Any]) -> None:
    row = issue(gateways["urls"]["gpu-hour"], ("cost-gpu",))
    assert set(_calls(gateways["urls"]["gpu-hour"], row["virtual_key"], "cost-gpu", 3)) == {"ok"}
    _settled(stack, row["id"], 3)
    out = stack.cli("--json", "gateway", "spend", "--by", "provider")
    assert out.returncode == 0, out.stderr
    rows = {r["provider"]: r for r in json.loads(out.stdout)}
    with stack.redis_client() as r:
        streams = [k for k in r.scan_iter("{vk:*}:cost")]
        recs = [f for s in streams for _id, f in r.xrange(s)]  # type: ignore[union-attr]
    for provider in ("prices", "gpu-hour", CUSTOM):
        mine = [x for x in recs if x.get("provider") == provider]
        assert rows[provider]["requests"] == len(mine)
        assert rows[provider]["cost_micro_usd"] == sum(int(x["cost_micro_usd"]) for x in mine)
        assert rows[provider]["clamped_micro_usd"] == sum(int(x.get("clamped") or 0) for x in mine)
    table = stack.cli("gateway", "spend", "--by", "provider")
    assert table.returncode == 0 and "gpu-hour" in table.stdout and "clamped USD" in table.stdout


@pytest.mark.parametrize("value", ["bogus", "examlops_testsupport.nowhere:X", CUSTOM.replace("PerCallFee", "Nope"),
                                   "examlops_testsupport.cost_providers:NotAProvider"])
def test_a_bad_provider_refuses_to_start(stack: Stack, value: str) -> None:
    env = {**stack.env("gateway"), PROVIDER: value, "EXAMLOPS_PORT": "0"}
    out = subprocess.run(service_argv("gateway"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"invalid setting {PROVIDER}:" in out.stderr and value in out.stderr, out.stderr


def test_ticket_cost_usd_is_the_recorded_cost(stack: Stack) -> None:
    """In process: a settled call's ticket.cost_usd is the cost its record says, under each provider."""
    async def run(provider: str) -> tuple[float | None, dict[str, str]]:
        settings = GatewaySettings(dev_mode=True, redis_url=stack.env("gateway")["EXAMLOPS_REDIS_URL"],
                                   llm_cost_provider=provider)
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        book = PriceBook({"t-cost": Price(1_000_000, 2_000_000, 3_600_000, 1, 5.0)})
        gov = Governor(settings, client, book, "t-replica")
        ticket = gov.admin_ticket("t-cost", b"{}", time.perf_counter() - 0.5)
        await ticket.settle("200", ep_pb.Usage(prompt_tokens=30, completion_tokens=20))
        last = (await client.xrevrange("{vk:admin}:cost", count=1))[0][1]
        await client.aclose()
        return ticket.cost_usd, last
    for provider in ("prices", "gpu-hour", CUSTOM):
        cost_usd, rec = asyncio.run(run(provider))
        assert rec["provider"] == provider and rec["model"] == "t-cost"
        assert cost_usd == int(rec["cost_micro_usd"]) / 1e6 > 0
    assert asyncio.run(run("prices"))[0] == (30 * 1 + 20 * 2) / 1e6
