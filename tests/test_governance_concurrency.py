"""Budgets and rate limits hold under concurrency across two gateway processes sharing one Redis;
a gateway killed mid-request leaves no reservation behind once the reaper has run.

Overshoot bound under test: zero. Spend never passes the budget, because every call's reservation
is an upper bound of its real cost (text prompts, see services/gateway/.../_budget.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
import redis

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until

FAST = {"EXAMLOPS_PRICE_REFRESH_S": "0.2", "EXAMLOPS_HEARTBEAT_S": "0.2", "EXAMLOPS_REPLICA_TTL_S": "1",
        "EXAMLOPS_REAPER_INTERVAL_S": "0.5"}
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
REQUESTS = 200


class SlowServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that streams one word every 50 ms (HTTP/1.0: the body ends at close)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        words = min(int(body.get("max_tokens") or 400), 400)
        base = {"id": "slow-1", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        try:
            for i in range(words):
                delta = {"content": f" w{i}"}
                chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.05)
            usage = {"prompt_tokens": 3, "completion_tokens": words, "total_tokens": 3 + words}
            self.wfile.write(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture(scope="module")
def slow_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
        slow_url: str) -> Iterator[tuple[Stack, list[str]]]:
    """The stack's gateway and a second replica, both with fast heartbeats and price refresh."""
    with running_stack(tmp_path_factory.mktemp("conc"), redis_server, FAST) as stack:
        _proc, second = stack.start_gateway_replica("gateway-2")
        stack.register("conc-a", engine="echo", project="conc")
        stack.register("slow", engine="vllm-server", base_url=slow_url, project="conc")
        for model in ("conc-a", "slow"):
            assert stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1",
                             "--output-per-mtok", "2").returncode == 0
        urls = [stack.gateway_url, second]
        for url in urls:
            wait_until(lambda url=url: _ready(url), 10)
        yield stack, urls


def _ready(url: str) -> bool:
    models = {m["id"] for m in httpx.get(url + "/v1/models", headers=ADMIN).json()["data"]}
    prices = {p["model"] for p in httpx.get(url + "/admin/prices", headers=ADMIN).json()["data"]}
    return {"conc-a", "slow"} <= models and {"conc-a", "slow"} <= prices


def issue(url: str, **limits: Any) -> dict[str, Any]:
    resp = httpx.post(url + "/admin/keys", headers=ADMIN,
                      json={"tenant": "load", "project": "conc", "models": ["conc-a", "slow"], **limits})
    assert resp.status_code == 201, resp.text
    row: dict[str, Any] = resp.json()
    return row


def key_hash(stack: Stack, key_id: str) -> dict[str, str]:
    r = redis.Redis(port=stack.ports.redis, decode_responses=True)
    try:
        return r.hgetall("{vk:" + key_id + "}:key")  # type: ignore[return-value]
    finally:
        r.close()


def open_reservations(stack: Stack, key_id: str) -> list[str]:
    r = redis.Redis(port=stack.ports.redis, decode_responses=True)
    try:
        return [f for f in r.hkeys("{vk:" + key_id + "}:res") if not f.startswith("reaped:")]  # type: ignore[union-attr]
    finally:
        r.close()


def cost_records(stack: Stack, key_id: str) -> list[dict[str, str]]:
    r = redis.Redis(port=stack.ports.redis, decode_responses=True)
    try:
        return [f for _id, f in r.xrange("{vk:" + key_id + "}:cost")]  # type: ignore[union-attr]
    finally:
        r.close()


async def _one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int, int, Any]:
    """One call in one of three shapes; returns (outcome, prompt tokens, completion tokens, error)."""
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


def burst(urls: list[str], key: str, n: int = REQUESTS) -> tuple[list[tuple[str, int, int, Any]], float]:
    """n calls at once, alternating between the replicas; returns the outcomes and the seconds taken."""
    async def run() -> list[tuple[str, int, int, Any]]:
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=key, max_retries=0, timeout=60) for u in urls]
        try:
            return list(await asyncio.gather(*[_one(clients[i % len(clients)], i) for i in range(n)]))
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
                resp = clients[i % 2].chat.completions.create(
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


def test_budget_is_never_overspent_by_concurrent_calls_on_two_replicas(two: tuple[Stack, list[str]]) -> None:
    stack, urls = two
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


def test_rpm_holds_across_two_replicas(two: tuple[Stack, list[str]]) -> None:
    stack, urls = two
    rpm = 20
    row = issue(urls[0], rpm=rpm)
    results, elapsed = burst(urls, row["virtual_key"])
    ok = [r for r in results if r[0] == "ok"]
    limited = [r for r in results if r[0] == "rate_limit_exceeded"]
    assert len(ok) + len(limited) == REQUESTS, {r[0]: str(r[3])[:300] for r in results}
    # GCRA: a burst of rpm, then rpm per minute
    assert rpm <= len(ok) <= rpm + int(elapsed * rpm / 60) + 1
    assert all(int(r[3].response.headers["retry-after"]) >= 1 for r in limited)
    wait_until(lambda: not open_reservations(stack, row["id"]), 5)
    assert int(key_hash(stack, row["id"])["requests"]) == len(ok)


def test_tpm_holds_across_two_replicas(two: tuple[Stack, list[str]]) -> None:
    stack, urls = two
    tpm = 2000
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
    assert tpm / 2 < used <= tpm + elapsed * tpm / 60  # the real tokens admitted fit the bucket and its refill
    wait_until(lambda: not open_reservations(stack, row["id"]), 5)
    f = key_hash(stack, row["id"])
    assert int(f["prompt_tokens"]) + int(f["completion_tokens"]) == used


def _start_stream(url: str, key: str, max_tokens: int = 200) -> tuple[httpx.Client, httpx.Response, Any]:
    """Open a streamed call to the slow endpoint and read its first chunks."""
    http = httpx.Client(timeout=30)
    body = {"model": "slow", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "talk slowly"}]}
    resp = http.send(http.build_request("POST", url + "/v1/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {key}"}), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    seen = 0
    for line in lines:
        if line.startswith("data: "):
            seen += 1
            if seen == 3:
                break
    return http, resp, lines


def test_gateway_killed_mid_request_leaves_no_reservation_after_the_reaper(two: tuple[Stack, list[str]]) -> None:
    stack, _urls = two
    proc, url = stack.start_gateway_replica("gateway-doomed")
    wait_until(lambda: _ready(url), 10)
    row = issue(url, budget_usd=1)
    http, _resp, _lines = _start_stream(url, row["virtual_key"])
    assert len(open_reservations(stack, row["id"])) == 1 and int(key_hash(stack, row["id"])["reserved"]) > 0
    assert isinstance(proc, Proc)
    proc.stop(signal.SIGKILL)
    http.close()
    # the other replicas' reapers notice the dead replica (its heartbeat stops) and give the reservation back
    wait_until(lambda: not open_reservations(stack, row["id"]), 15, 0.1)
    f = key_hash(stack, row["id"])
    assert f["reserved"] == "0" and f["reaped"] == "1"
    records = cost_records(stack, row["id"])
    assert [r["status"] for r in records] == ["reaped"]
    assert sum(int(r["cost_micro_usd"]) for r in records) == int(f["spent"])


def test_client_gone_mid_stream_is_charged_what_was_produced(two: tuple[Stack, list[str]]) -> None:
    stack, urls = two
    row = issue(urls[0], budget_usd=1)
    http, resp, _lines = _start_stream(urls[0], row["virtual_key"])
    resp.close()
    http.close()
    wait_until(lambda: cost_records(stack, row["id"]), 10, 0.05)
    (record,) = cost_records(stack, row["id"])
    assert record["status"] == "499" and record["estimated"] == "1"
    assert 3 <= int(record["completion_tokens"]) < 200  # stopped early, charged for what was sent
    f = key_hash(stack, row["id"])
    assert f["reserved"] == "0" and int(f["spent"]) == int(record["cost_micro_usd"]) > 0
    assert open_reservations(stack, row["id"]) == []


def test_engine_failure_charges_nothing_when_nothing_came_back(two: tuple[Stack, list[str]]) -> None:
    stack, urls = two
    stack.register("conc-dead", engine="vllm-server", base_url="http://127.0.0.1:9", project="conc")
    assert stack.cli("gateway", "price", "set", "conc-dead", "--input-per-mtok", "1",
                     "--output-per-mtok", "1").returncode == 0
    resp = httpx.post(urls[0] + "/admin/keys", headers=ADMIN, json={
        "tenant": "t", "project": "conc", "models": ["conc-dead"], "budget_usd": 1})
    key = resp.json()
    c = openai.OpenAI(base_url=urls[1] + "/v1", api_key=key["virtual_key"], max_retries=0)

    def failed() -> bool:
        try:
            c.chat.completions.create(model="conc-dead", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as exc:
            return exc.status_code == 502
        return False
    wait_until(failed, 10, 0.1)
    wait_until(lambda: not open_reservations(stack, key["id"]), 5)
    f = key_hash(stack, key["id"])
    assert f["spent"] == "0" and f["reserved"] == "0"
    assert {r["status"] for r in cost_records(stack, key["id"])} <= {"502", "404"}
