"""Gateway governance as a user meets it: virtual keys, prices, budgets, rate limits, cost, audit.

The official openai client against real services and a real Redis; operators use `exa`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until

FAST = {"EXAMLOPS_PRICE_REFRESH_S": "0.2", "EXAMLOPS_HEARTBEAT_S": "0.2", "EXAMLOPS_REPLICA_TTL_S": "1",
        "EXAMLOPS_REAPER_INTERVAL_S": "0.5"}
PROJECT = "govproj"
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}


@pytest.fixture(scope="module")
def gov(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("gov"), redis_server, FAST) as stack:
        for name in ("gov-a", "gov-b", "gov-c"):
            stack.register(name, engine="echo", project=PROJECT)
        wait_until(lambda: {"gov-a", "gov-b", "gov-c"} <= _models(stack, DEFAULT_ADMIN_KEY), 10)
        set_price(stack, "gov-a", 1, 2)   # 1 micro-USD per prompt token, 2 per completion token
        set_price(stack, "gov-b", 1, 2)
        yield stack


def _models(stack: Stack, key: str) -> set[str]:
    resp = httpx.get(stack.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return {m["id"] for m in resp.json().get("data", [])}


def set_price(stack: Stack, model: str, input_usd: float, output_usd: float) -> None:
    out = stack.cli("gateway", "price", "set", model, "--input-per-mtok", str(input_usd),
                    "--output-per-mtok", str(output_usd))
    assert out.returncode == 0, out.stderr

    def seen() -> bool:
        prices = httpx.get(stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]
        return any(p["model"] == model and p["input_per_mtok"] == input_usd for p in prices)
    wait_until(seen, 10)


def issue(stack: Stack, *args: str) -> dict[str, Any]:
    out = stack.cli("--json", "gateway", "key", "issue", "--tenant", "acme", "--project", PROJECT, *args)
    assert out.returncode == 0, out.stderr
    row: dict[str, Any] = json.loads(out.stdout)
    assert row["virtual_key"].startswith("sk-exa-")
    return row


def settled(stack: Stack, key_id: str) -> None:
    """Wait until the key's calls are settled (a whole answer is settled just after it is sent)."""
    r = redis.Redis(port=stack.ports.redis, decode_responses=True)
    try:
        wait_until(lambda: not [f for f in r.hkeys("{vk:" + key_id + "}:res")  # type: ignore[union-attr]
                                if not f.startswith("reaped:")], 5)
    finally:
        r.close()


def key_row(stack: Stack, key_id: str) -> dict[str, Any]:
    settled(stack, key_id)
    out = stack.cli("--json", "gateway", "key", "list", "--all")
    assert out.returncode == 0, out.stderr
    row: dict[str, Any] = next(r for r in json.loads(out.stdout) if r["id"] == key_id)
    return row


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)


def chat(c: openai.OpenAI, model: str, text: str, **kw: Any) -> Any:
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kw)


def error_code(exc: openai.APIStatusError) -> str:
    body = exc.body
    assert isinstance(body, dict)
    return str(body["code"])


def test_key_allows_only_its_models_and_revoked_key_is_401(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a")
    c = client(gov, row["virtual_key"])
    assert chat(c, "gov-a", "hello there").choices[0].message.content == "echo: hello there"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        chat(c, "gov-b", "not mine")
    assert denied.value.status_code == 403 and error_code(denied.value) == "model_not_allowed"
    assert _models(gov, row["virtual_key"]) == {"gov-a"}

    out = gov.cli("gateway", "key", "revoke", row["id"])
    assert out.returncode == 0 and "revoked" in out.stdout
    with pytest.raises(openai.AuthenticationError) as revoked:
        chat(c, "gov-a", "after revoke")
    assert error_code(revoked.value) == "key_revoked"
    assert key_row(gov, row["id"])["state"] == "revoked"
    for bad in (row["virtual_key"][:-1] + "x", "sk-exa-0123456789ab-nope", "plainly-wrong"):
        with pytest.raises(openai.AuthenticationError):
            chat(client(gov, bad), "gov-a", "x")


def test_key_list_shows_the_spend_move_after_a_chat(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a", "--budget", "20")
    assert (row["budget"], row["spend"], row["remaining"], row["requests"]) == (20, 0, 20, 0)
    c = client(gov, row["virtual_key"])
    resp = chat(c, "gov-a", "summarise this alert")
    expected = resp.usage.prompt_tokens * 1 + resp.usage.completion_tokens * 2
    after = key_row(gov, row["id"])
    assert after["spend_micro_usd"] == expected and after["requests"] == 1 and after["reserved"] == 0
    assert after["remaining"] == pytest.approx(20 - expected / 1e6)

    # a stream that did not ask for usage is charged from the engine's usage all the same
    chunks = list(c.chat.completions.create(model="gov-a", stream=True,
                                            messages=[{"role": "user", "content": "one two three"}]))
    assert all(ch.usage is None for ch in chunks)
    streamed = key_row(gov, row["id"])
    assert streamed["spend_micro_usd"] == expected + (3 + 2 * 4) and streamed["requests"] == 2

    human = gov.cli("gateway", "key", "list")
    assert human.returncode == 0 and row["id"] in human.stdout and "remaining" in human.stdout

    # the operator's flow: exa gateway chat --key, then the key's spend has moved again
    out = gov.cli("gateway", "chat", "gov-a", "--message", "Summarise this alert", "--key", row["virtual_key"])
    assert out.returncode == 0 and out.stdout.strip() == "echo: Summarise this alert"
    assert key_row(gov, row["id"])["spend_micro_usd"] == streamed["spend_micro_usd"] + 3 + 2 * 4
    refused = gov.cli("gateway", "chat", "gov-b", "--message", "x", "--key", row["virtual_key"])
    assert refused.returncode == 1 and "model_not_allowed" in refused.stderr


def test_unpriced_model_is_refused_for_budgeted_keys_only(gov: Stack) -> None:
    budgeted = issue(gov, "--model", "gov-c", "--budget", "1")
    with pytest.raises(openai.PermissionDeniedError) as info:
        chat(client(gov, budgeted["virtual_key"]), "gov-c", "x")
    assert error_code(info.value) == "model_not_priced" and "exa gateway price set" in str(info.value)
    free = issue(gov, "--model", "gov-c")
    assert chat(client(gov, free["virtual_key"]), "gov-c", "x").choices[0].message.content == "echo: x"
    settled(gov, free["id"])
    assert chat(client(gov, DEFAULT_ADMIN_KEY), "gov-c", "admin x").choices[0].message.content == "echo: admin x"
    assert key_row(gov, free["id"])["spend_micro_usd"] == 0
    spend = json.loads(gov.cli("--json", "gateway", "spend", "--by", "key").stdout)
    assert next(r for r in spend if r["key"] == free["id"])["unpriced"] == 1


def test_budget_caps_max_tokens_then_refuses(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a", "--budget", "0.00045")  # 450 micro-USD
    c = client(gov, row["virtual_key"])
    words = " ".join(f"w{i}" for i in range(60))  # echo answers 61 tokens; the budget pays for fewer
    resp = chat(c, "gov-a", words, max_tokens=1000)
    assert resp.choices[0].finish_reason == "length"
    assert 1 <= resp.usage.completion_tokens < 61
    spent = key_row(gov, row["id"])["spend_micro_usd"]
    assert spent == 60 + 2 * resp.usage.completion_tokens <= 450
    with pytest.raises(openai.RateLimitError) as info:
        chat(c, "gov-a", words)
    assert error_code(info.value) == "budget_exceeded"
    assert info.value.response.headers.get("x-should-retry") == "false"
    after = key_row(gov, row["id"])
    assert after["spend_micro_usd"] == spent and after["reserved"] == 0

    # raising the budget is audited and takes effect at once
    assert gov.cli("gateway", "key", "update", row["id"], "--budget", "1").returncode == 0
    assert chat(c, "gov-a", "again").choices[0].message.content == "echo: again"


def test_expired_key_is_401(gov: Stack) -> None:
    """`--expires` is recorded; once Redis' clock passes it, the key is 401 key_expired. The expiry is
    moved relative to Redis TIME (the clock the scripts judge by), so a slow CLI start changes nothing."""
    before = time.time()
    row = issue(gov, "--model", "gov-a", "--expires", "1h")
    assert before + 3600 - 1 <= row["expires_at"] <= time.time() + 3600 + 1
    c = client(gov, row["virtual_key"])
    assert chat(c, "gov-a", "still valid").choices[0].message.content == "echo: still valid"
    r = redis.Redis(port=gov.ports.redis, decode_responses=True)
    try:
        secs, micros = r.time()  # type: ignore[misc]
        r.hset("{vk:" + row["id"] + "}:key", "expires_ms", int(secs) * 1000 + int(micros) // 1000)
    finally:
        r.close()
    with pytest.raises(openai.AuthenticationError) as info:
        chat(c, "gov-a", "x")
    assert error_code(info.value) == "key_expired"
    assert key_row(gov, row["id"])["state"] == "expired"


def test_models_and_generation_agree_on_expiry_by_redis_clock(gov: Stack) -> None:
    """/v1/models and a generation judge a key by one check on Redis' clock: a key whose expiry is
    set relative to Redis TIME is valid for both before it, and expired for both from it on."""
    row = issue(gov, "--model", "gov-a")
    key, record = row["virtual_key"], "{vk:" + row["id"] + "}:key"
    c = client(gov, key)
    r = redis.Redis(port=gov.ports.redis, decode_responses=True)

    def redis_now_ms() -> int:
        secs, micros = r.time()  # type: ignore[misc]
        return int(secs) * 1000 + int(micros) // 1000

    def both_refuse() -> None:
        listed = httpx.get(gov.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert listed.status_code == 401 and listed.json()["error"]["code"] == "key_expired", listed.text
        with pytest.raises(openai.AuthenticationError) as refused:
            chat(c, "gov-a", "x")
        assert error_code(refused.value) == "key_expired"

    try:
        expires = redis_now_ms() + 3000
        r.hset(record, "expires_ms", expires)
        assert _models(gov, key) == {"gov-a"}
        assert chat(c, "gov-a", "before").choices[0].message.content == "echo: before"
        wait_until(lambda: redis_now_ms() >= expires, 10, 0.05)
        both_refuse()
        r.hset(record, "expires_ms", redis_now_ms())  # the expiry instant itself counts as expired
        both_refuse()
    finally:
        r.close()


def test_rate_limit_is_429_with_retry_after(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a", "--rpm", "2")
    c = client(gov, row["virtual_key"])
    chat(c, "gov-a", "one")
    chat(c, "gov-a", "two")
    with pytest.raises(openai.RateLimitError) as info:
        chat(c, "gov-a", "three")
    assert error_code(info.value) == "rate_limit_exceeded"
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 30


def test_spend_summary_matches_the_keys(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a", "--model", "gov-b", "--budget", "5")
    c = client(gov, row["virtual_key"])
    for model in ("gov-a", "gov-b", "gov-b"):
        chat(c, model, f"bill {model}")
    settled(gov, row["id"])
    by_key = json.loads(gov.cli("--json", "gateway", "spend", "--by", "key").stdout)
    mine = next(r for r in by_key if r["key"] == row["id"])
    assert mine["requests"] == 3 and mine["cost_micro_usd"] == key_row(gov, row["id"])["spend_micro_usd"]
    by_model = {r["model"]: r for r in json.loads(gov.cli("--json", "gateway", "spend", "--by", "model").stdout)}
    assert by_model["gov-b"]["requests"] >= 2
    by_project = json.loads(gov.cli("--json", "gateway", "spend", "--by", "project", "--since", "1h").stdout)
    assert any(r["project"] == PROJECT and r["cost_micro_usd"] >= mine["cost_micro_usd"] for r in by_project)
    human = gov.cli("gateway", "spend", "--by", "project")
    assert human.returncode == 0 and PROJECT in human.stdout


def test_mutations_are_audited_and_attributed(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a", "--budget", "3")
    assert gov.cli("gateway", "key", "update", row["id"], "--budget", "4", "--rpm", "100").returncode == 0
    assert gov.cli("gateway", "key", "revoke", row["id"]).returncode == 0
    events = json.loads(gov.cli("--json", "audit", "list", "--target", f"key:{row['id']}").stdout)
    assert [e["action"] for e in events] == ["key.revoke", "key.update", "key.issue"]
    update = next(e for e in events if e["action"] == "key.update")
    assert json.loads(update["before_json"])["budget"] == 3 and json.loads(update["after_json"])["budget"] == 4
    assert row["virtual_key"] not in json.dumps(events)
    prices = json.loads(gov.cli("--json", "audit", "list", "--target", "price:gov-a").stdout)
    assert prices and prices[0]["action"] == "price.set"

    resources = gov.registry().ListProjectResources(reg.ListProjectResourcesRequest(project=PROJECT), timeout=5)
    kinds = {(r.kind, r.name) for r in resources.resources}
    assert ("virtual_key", row["id"]) in kinds and ("serving_endpoint", "gov-a") in kinds


def _denials(stack: Stack, reason: str) -> float:
    metrics = httpx.get(stack.gateway_url + "/metrics").text
    line = f'examlops_gateway_denials_total{{reason="{reason}"}} '
    return next((float(m.removeprefix(line)) for m in metrics.splitlines() if m.startswith(line)), 0.0)


def test_prometheus_counters_by_model_and_project(gov: Stack) -> None:
    """Stands alone: it makes the call and the denial it counts (a fresh gateway has no labelled series)."""
    row = issue(gov, "--model", "gov-a", "--budget", "1")
    c = client(gov, row["virtual_key"])
    chat(c, "gov-a", "count me in")
    denied_before = _denials(gov, "model_not_allowed")
    with pytest.raises(openai.PermissionDeniedError):
        chat(c, "gov-b", "not on my list")
    metrics = httpx.get(gov.gateway_url + "/metrics").text
    assert f'examlops_gateway_calls_total{{model="gov-a",project="{PROJECT}",status="200"}}' in metrics
    assert f'examlops_gateway_cost_usd_total{{model="gov-a",project="{PROJECT}"}}' in metrics
    assert f'examlops_gateway_tokens_total{{model="gov-a",project="{PROJECT}",type="completion"}}' in metrics
    assert _denials(gov, "model_not_allowed") == denied_before + 1


def test_admin_api_needs_the_admin_key_and_validates(gov: Stack) -> None:
    row = issue(gov, "--model", "gov-a")
    resp = httpx.get(gov.gateway_url + "/admin/keys", headers={"Authorization": f"Bearer {row['virtual_key']}"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "admin_key_required"
    assert httpx.get(gov.gateway_url + "/admin/keys").status_code == 401
    bad = httpx.post(gov.gateway_url + "/admin/keys", headers=ADMIN,
                     json={"tenant": "t", "project": "p", "models": ["a,b"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "models"
    out = gov.cli("gateway", "key", "revoke", "000000000000")
    assert out.returncode == 1 and "key_not_found" in out.stderr
    out = gov.cli("gateway", "key", "issue", "--tenant", "t", "--project", "p", "--model", "m", "--expires", "soon")
    assert out.returncode == 1 and "--expires" in out.stderr
    listed = json.loads(gov.cli("--json", "gateway", "price", "list").stdout)
    assert {"model": "gov-a", "input_per_mtok": 1.0, "output_per_mtok": 2.0}.items() <= next(
        p for p in listed if p["model"] == "gov-a").items()


def test_virtual_key_row_shape(gov: Stack, tmp_path: Path) -> None:
    row = issue(gov, "--model", "gov-a", "--budget", "2", "--rpm", "60", "--tpm", "10000")
    listed = key_row(gov, row["id"])
    for field in ("id", "tenant", "project", "models", "budget", "spend", "remaining", "requests"):
        assert field in listed
    assert listed["models"] == ["gov-a"] and listed["rpm"] == 60 and listed["tpm"] == 10000
    assert "virtual_key" not in listed and "hash" not in listed
    assert time.time() - 60 < listed["created_at"] <= time.time() + 1


def test_price_rules_in_the_registry(gov: Stack) -> None:
    import grpc

    from examlops.svc import error_reason

    r = gov.registry()
    for bad, field in [(reg.Price(model="bad name"), "model"),
                       (reg.Price(model="m", input_micro_usd_per_mtok=-1), "input_micro_usd_per_mtok")]:
        with pytest.raises(grpc.RpcError) as info:
            r.SetPrice(reg.SetPriceRequest(price=bad, actor="tests"), timeout=5)
        assert error_reason(info.value) == ("invalid_price", field)  # type: ignore[arg-type]
    out = gov.cli("gateway", "price", "set", "gov-tmp", "--input-per-mtok", "0.15", "--output-per-mtok", "0.6")
    assert out.returncode == 0 and "gov-tmp" in out.stdout
    price = next(p for p in r.ListPrices(reg.ListPricesRequest(), timeout=5).prices if p.model == "gov-tmp")
    assert (price.input_micro_usd_per_mtok, price.output_micro_usd_per_mtok) == (150_000, 600_000)
    assert price.updated_by and price.updated_at_ms > 0
    r.RemovePrice(reg.RemovePriceRequest(model="gov-tmp", actor="tests"), timeout=5)
    assert all(p.model != "gov-tmp" for p in r.ListPrices(reg.ListPricesRequest(), timeout=5).prices)
    with pytest.raises(grpc.RpcError):
        r.RemovePrice(reg.RemovePriceRequest(model="gov-tmp", actor="tests"), timeout=5)


def test_endpoint_attribution_follows_the_endpoint(gov: Stack) -> None:
    r = gov.registry()

    def attributed() -> set[tuple[str, str]]:
        found = r.ListProjectResources(reg.ListProjectResourcesRequest(kind="serving_endpoint"), timeout=5)
        return {(x.project, x.name) for x in found.resources}

    gov.register("gov-attr", engine="echo", project="proj-x")
    assert ("proj-x", "gov-attr") in attributed()
    gov.register("gov-attr", engine="echo", project="proj-y")
    assert ("proj-y", "gov-attr") in attributed() and ("proj-x", "gov-attr") not in attributed()
    r.RemoveEndpoint(reg.RemoveEndpointRequest(name="gov-attr", actor="tests"), timeout=5)
    assert not {a for a in attributed() if a[1] == "gov-attr"}
