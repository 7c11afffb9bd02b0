"""Budgets and rate limits hold under concurrency across two gateway processes sharing one Redis;
a gateway killed mid-request leaves no reservation behind once the reaper has run.

Overshoot bound under test: zero. Spend never passes the budget, because every call's reservation
is an upper bound of its real cost (text prompts, see services/gateway/.../_budget.py).
"""

from __future__ import annotations

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

from examlops_devstack import Proc
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until
from examlops_testsupport.governance import (
    ADMIN,
    FAST,
    check_budget_never_overspent,
    check_rpm_holds,
    check_tpm_holds,
    cost_records,
    issue,
    key_hash,
    open_reservations,
    routes_and_prices_synced,
)


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
            wait_until(lambda url=url: routes_and_prices_synced(url), 10)
        yield stack, urls


def test_budget_is_never_overspent_by_concurrent_calls_on_two_replicas(two: tuple[Stack, list[str]]) -> None:
    check_budget_never_overspent(*two)


def test_rpm_holds_across_two_replicas(two: tuple[Stack, list[str]]) -> None:
    check_rpm_holds(*two)


def test_tpm_holds_across_two_replicas(two: tuple[Stack, list[str]]) -> None:
    check_tpm_holds(*two)


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
    wait_until(lambda: routes_and_prices_synced(url), 10)
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
