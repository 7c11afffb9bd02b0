"""The exact response cache as users meet it: operators set policies with `exa`, clients call through
the gateway with the official openai client, the echo engine answers misses, Redis holds what the
cache kept and the cost records. (Policies' CLI and audit: test_cache_admin.py; semantic mode and
two gateway processes: test_cache_semantic.py.)"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from examlops_testsupport.cache import ask, ask_stream, cache_cli, issue, key_id, last_cost, stored
from examlops_testsupport.fixtures import RedisServer, Stack, wait_until
from examlops_testsupport.guardrails import ADMIN, register_echo, set_policy
from examlops_testsupport.guardrails import guardrail as guardrail_cli


def _spend(stack: Stack, key: str) -> dict[str, int]:
    row = httpx.get(f"{stack.gateway_url}/admin/keys/{key_id(key)}", headers=ADMIN).json()
    return {k: int(row[k]) for k in ("spend_micro_usd", "requests", "completion_tokens")}


def test_an_exact_hit_answers_both_modes_costs_nothing_and_is_recorded(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-exact")
    out = stack.cli("gateway", "price", "set", "c-exact", "--input-per-mtok", "1", "--output-per-mtok", "2")
    assert out.returncode == 0, out.stderr
    wait_until(lambda: any(p["model"] == "c-exact" for p in httpx.get(
        stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]), 10, what="the price reaches the gateway")
    cache_cli(stack, "set", "--model", "c-exact", "--mode", "exact")
    key = issue(stack, "c-exact", "t", "cache", "--budget", "5")
    url = stack.gateway_url

    text, header, first = ask(key, "c-exact", "what is a cache", url)
    assert (text, header) == ("echo: what is a cache", "miss")
    assert last_cost(redis_server, key)["cache"] == "miss"
    wait_until(lambda: stored(redis_server, "c-exact") == 1, 5, what="the answer is kept")
    before = _spend(stack, key)
    assert before["spend_micro_usd"] > 0

    text, header, again = ask(key, "c-exact", "what is a cache", url)
    assert (text, header) == ("echo: what is a cache", "hit-exact")
    assert again.id != first.id and again.usage == first.usage  # a fresh id, the original's usage
    streamed, header, chunks = ask_stream(key, "c-exact", "what is a cache", url)
    assert (streamed, header) == ("echo: what is a cache", "hit-exact")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == first.usage  # the usage chunk, as asked

    wait_until(lambda: _spend(stack, key)["requests"] == before["requests"] + 2, 5, what="the hits are settled")
    after = _spend(stack, key)
    assert after["spend_micro_usd"] == before["spend_micro_usd"]  # a hit costs nothing
    assert after["completion_tokens"] == before["completion_tokens"]
    record = last_cost(redis_server, key)
    assert record["cache"] == "hit-exact" and record["cost_micro_usd"] == "0" and record["status"] == "200", record
    metrics = httpx.get(url + "/metrics").text
    assert 'examlops_gateway_cache_lookups_total{mode="exact",model="c-exact",result="hit-exact"} 2.0' in metrics
    assert 'examlops_gateway_cache_stores_total{mode="exact",model="c-exact"} 1.0' in metrics


def test_a_streamed_miss_is_kept_whole_and_answers_a_plain_call(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-stream")
    cache_cli(stack, "set", "--model", "c-stream", "--mode", "exact")
    key = issue(stack, "c-stream")
    text, header, chunks = ask_stream(key, "c-stream", "tell me three things", stack.gateway_url)
    assert (text, header) == ("echo: tell me three things", "miss")
    wait_until(lambda: stored(redis_server, "c-stream") == 1, 5, what="the stream's answer is kept")
    whole, header, done = ask(key, "c-stream", "tell me three things", stack.gateway_url)
    assert (whole, header) == (text, "hit-exact")
    assert done.usage == chunks[-1].usage and done.choices[0].finish_reason == "stop"


def test_a_hit_still_counts_against_the_rate_limit(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-rpm")
    cache_cli(stack, "set", "--model", "c-rpm", "--mode", "exact")
    key = issue(stack, "c-rpm", "t", "cache", "--rpm", "3")
    assert ask(key, "c-rpm", "same question", stack.gateway_url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-rpm") == 1, 5, what="the answer is kept")
    assert [ask(key, "c-rpm", "same question", stack.gateway_url)[1] for _ in range(2)] == ["hit-exact"] * 2
    with pytest.raises(openai.RateLimitError) as exc:
        ask(key, "c-rpm", "same question", stack.gateway_url)
    assert isinstance(exc.value.body, dict) and exc.value.body["code"] == "rate_limit_exceeded"


def test_answers_expire_with_the_policy_ttl(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-ttl")
    cache_cli(stack, "set", "--model", "c-ttl", "--mode", "exact", "--ttl", "1")
    key = issue(stack, "c-ttl")
    assert ask(key, "c-ttl", "short lived", stack.gateway_url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-ttl") == 1, 5, what="the answer is kept")
    assert ask(key, "c-ttl", "short lived", stack.gateway_url)[1] == "hit-exact"
    wait_until(lambda: stored(redis_server, "c-ttl") == 0, 5, what="the answer expires")
    assert ask(key, "c-ttl", "short lived", stack.gateway_url)[1] == "miss"


def test_cache_control_no_store_keeps_nothing_and_no_cache_skips_the_lookup(
        stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-ctl")
    cache_cli(stack, "set", "--model", "c-ctl", "--mode", "exact")
    key, url = issue(stack, "c-ctl"), stack.gateway_url
    assert ask(key, "c-ctl", "keep out", url, headers={"Cache-Control": "no-store"})[1] == "miss"
    time.sleep(0.5)  # a store would be done by now: it runs right after the answer
    assert stored(redis_server, "c-ctl") == 0
    assert ask(key, "c-ctl", "keep out", url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-ctl") == 1, 5, what="the answer is kept")
    assert ask(key, "c-ctl", "keep out", url, headers={"Cache-Control": "no-cache"})[1] == "bypass"
    assert last_cost(redis_server, key)["cache"] == "bypass"
    assert ask(key, "c-ctl", "keep out", url, headers={"Cache-Control": "no-cache, no-store"})[1] == "bypass"
    assert ask(key, "c-ctl", "keep out", url)[1] == "hit-exact"


def test_only_deterministic_plain_requests_are_cached_unless_sampled(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-det")
    cache_cli(stack, "set", "--model", "c-det", "--mode", "exact")
    key, url = issue(stack, "c-det"), stack.gateway_url
    assert ask(key, "c-det", "roll a die", url, temperature=0.8)[1] == "bypass"
    assert ask(key, "c-det", "roll a die", url, temperature=0.8, n=2)[1] == "bypass"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert ask(key, "c-det", "roll a die", url, tools=[tool])[1] == "bypass"
    assert ask(key, "c-det", "roll a die", url, temperature=0.8, seed=7)[1] == "miss"  # a seed is deterministic
    wait_until(lambda: stored(redis_server, "c-det") == 1, 5, what="the seeded answer is kept")
    assert ask(key, "c-det", "roll a die", url, temperature=0.8, seed=7)[1] == "hit-exact"
    assert ask(key, "c-det", "roll a die", url, temperature=0.8, seed=8)[1] == "miss"  # another request
    cache_cli(stack, "set", "--model", "c-det", "--mode", "exact", "--sampled")
    assert ask(key, "c-det", "roll again", url, temperature=0.8)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-det") == 3, 5, what="the sampled answer is kept")
    assert ask(key, "c-det", "roll again", url, temperature=0.8)[1] == "hit-exact"
    plain = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "c-det", "prompt": "roll", "temperature": 0})
    assert plain.status_code == 200 and plain.headers["x-examlops-cache"] == "bypass"  # chat only


def test_identical_prompts_of_two_tenants_never_share_an_answer(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-iso")
    cache_cli(stack, "set", "--model", "c-iso", "--mode", "exact", "--scope", "tenant")
    url, prompt = stack.gateway_url, "the quarterly numbers for acme"
    a1, a2 = issue(stack, "c-iso", "acme", "p1"), issue(stack, "c-iso", "acme", "p2")
    b1 = issue(stack, "c-iso", "globex", "p1")
    assert ask(a1, "c-iso", prompt, url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-iso") == 1, 5, what="tenant acme's answer is kept")
    assert ask(a2, "c-iso", prompt, url)[1] == "hit-exact"  # same tenant, another key and project
    assert ask(b1, "c-iso", prompt, url)[1] == "miss"       # another tenant, even with the same project name
    assert ask(ADMIN["Authorization"].split()[1], "c-iso", prompt, url)[1] == "miss"  # the admin key's own scope
    cache_cli(stack, "set", "--model", "c-iso", "--mode", "exact", "--scope", "project")
    assert ask(a2, "c-iso", prompt, url)[1] == "miss"       # the same tenant, another project
    cache_cli(stack, "set", "--model", "c-iso", "--mode", "exact")  # scope key
    assert ask(a1, "c-iso", prompt, url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-iso") == 5, 5, what="every scope's answer is kept")
    assert ask(a1, "c-iso", prompt, url)[1] == "hit-exact"
    assert ask(issue(stack, "c-iso", "acme", "p1"), "c-iso", prompt, url)[1] == "miss"  # another key


def test_a_hit_passes_the_output_guardrails_of_the_call(stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-guard")
    cache_cli(stack, "set", "--model", "c-guard", "--mode", "exact", "--scope", "project")
    url, prompt = stack.gateway_url, "mail bob.smith@example.com today"
    plain = issue(stack, "c-guard", "t", "shared")
    assert ask(plain, "c-guard", prompt, url)[:2] == (f"echo: {prompt}", "miss")
    wait_until(lambda: stored(redis_server, "c-guard") >= 1, 5, what="the answer is kept")
    set_policy(stack, "c-no-email-out", "--detector", "pii", "--entities", "EMAIL_ADDRESS", "--direction", "output",
               "--action", "redact")
    guarded = issue(stack, "c-guard", "t", "shared", "--guardrail", "c-no-email-out")
    text, header, _ = ask(guarded, "c-guard", prompt, url)
    assert (text, header) == ("echo: mail <EMAIL_ADDRESS> today", "hit-exact")
    assert ask(plain, "c-guard", prompt, url)[:2] == (f"echo: {prompt}", "hit-exact")
    guardrail_cli(stack, "set", "c-no-email-out", "--detector", "pii", "--entities", "EMAIL_ADDRESS",
                  "--direction", "output", "--action", "block")
    with pytest.raises(openai.BadRequestError) as exc:
        ask(guarded, "c-guard", prompt, url)
    assert isinstance(exc.value.body, dict) and exc.value.body["code"] == "guardrail_blocked"
