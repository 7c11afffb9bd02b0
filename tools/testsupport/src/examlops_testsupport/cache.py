"""Helpers of the response-cache tests: policies set with `exa`, keys of chosen tenants and projects,
calls with the official openai client that report the `x-examlops-cache` header, and what Redis holds."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import redis

from .fixtures import RedisServer, Stack, wait_until
from .guardrails import ADMIN

EXACT_PREFIX = "{exa:gw}:cache:x:"
SEMANTIC_PREFIX = "{exa:gw}:cache:s:"


def applied(url: str) -> bool:
    """Whether the gateway at `url` applies the cache policies in Redis (refreshed every 0.5 s)."""
    listing = httpx.get(url + "/admin/cache/policies", headers=ADMIN).json()
    return bool(listing["version"] == listing["applied"])


def cache_cli(stack: Stack, *args: str, urls: tuple[str, ...] = ()) -> Any:
    """`exa --json gateway cache ARGS` (it must succeed), once every gateway (`urls` too) applies it."""
    out = stack.cli("--json", "gateway", "cache", *args)
    assert out.returncode == 0, out.stderr + out.stdout
    for url in (stack.gateway_url, *urls):
        wait_until(lambda u=url: applied(u), 5, what="the gateway applies the cache policies")  # type: ignore[misc]
    return json.loads(out.stdout) if out.stdout.strip().startswith(("[", "{")) else out.stdout


def issue(stack: Stack, model: str, tenant: str = "t", project: str = "cache", *extra: str) -> str:
    out = stack.cli("--json", "gateway", "key", "issue", "--tenant", tenant, "--project", project, "--model", model,
                    *extra)
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["virtual_key"])


def key_id(key: str) -> str:
    return key.split("-")[2]


def ask(key: str, model: str, text: str, url: str, **extra: Any) -> tuple[str, str, Any]:
    """(answer text, x-examlops-cache, the parsed completion) of one non-streamed chat call."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    extra.setdefault("temperature", 0)
    headers = extra.pop("headers", None)
    resp = c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": text}],
                                                       extra_headers=headers, **extra)
    done = resp.parse()
    return done.choices[0].message.content or "", resp.headers.get("x-examlops-cache", ""), done


def ask_stream(key: str, model: str, text: str, url: str, **extra: Any) -> tuple[str, str, list[Any]]:
    """(the streamed text, x-examlops-cache, every chunk) of one streamed chat call with usage."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    extra.setdefault("temperature", 0)
    with c.chat.completions.with_streaming_response.create(
            model=model, messages=[{"role": "user", "content": text}], stream=True,
            stream_options={"include_usage": True}, **extra) as resp:
        header = resp.headers.get("x-examlops-cache", "")
        chunks = list(resp.parse())
    text_out = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text_out, header, chunks


def stored(redis_server: RedisServer, model: str, prefix: str = EXACT_PREFIX) -> int:
    """How many answers of `model` the cache holds (of one mode)."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        return sum(1 for _ in r.scan_iter(match=f"{prefix}{model}|*", count=1000))
    finally:
        r.close()


def last_cost(redis_server: RedisServer, key: str) -> dict[str, str]:
    """The newest cost record of a key (`admin` for the admin key)."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        kid = key if key == "admin" else key_id(key)
        (_, fields), = r.xrevrange("{vk:" + kid + "}:cost", count=1)
        return dict(fields)
    finally:
        r.close()
