"""Chaos on the real stack: parts killed mid-call, Redis lost under load, idle and slow-loris sockets.

Every test uses its own Redis and stack (Redis is killed here) and a streaming backend that
behaves like vLLM 0.32 (examlops_testsupport.stream_backend, its own process). What is asserted is
what a user or an operator notices: the error a client gets, the spend and records left in Redis.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc, free_port, spawn, wait_http
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis, wait_until
from examlops_testsupport.recorder import RecordingServer

FAST = {"EXAMLOPS_PRICE_REFRESH_S": "0.2", "EXAMLOPS_HEARTBEAT_S": "0.2", "EXAMLOPS_REPLICA_TTL_S": "1",
        "EXAMLOPS_REAPER_INTERVAL_S": "0.5"}
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
MODELS = ("slow", "bulky", "mute", "echo-c")


def start_backend(workdir: Path, name: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn(name, [sys.executable, "-m", "examlops_testsupport.stream_backend", "--port", str(port), *flags],
                 {}, workdir / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/metrics", 15, proc)
    return proc, url


class Chaos:
    def __init__(self, stack: Stack, redis_server: RedisServer, backends: dict[str, tuple[Proc, str]]) -> None:
        self.stack, self.redis_server, self.backends = stack, redis_server, backends

    def r(self) -> redis.Redis:
        return self.redis_server.client()

    def issue(self, **limits: Any) -> dict[str, Any]:
        resp = httpx.post(self.stack.gateway_url + "/admin/keys", headers=ADMIN, timeout=10, json={
            "tenant": "chaos", "project": "chaos", "models": list(MODELS), **limits})
        assert resp.status_code == 201, resp.text
        row: dict[str, Any] = resp.json()
        return row

    def client(self, key: str = DEFAULT_ADMIN_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=30)

    def records(self, key_id: str) -> list[dict[str, str]]:
        with self.r() as r:
            return [f for _id, f in r.xrange("{vk:" + key_id + "}:cost")]  # type: ignore[union-attr]

    def key(self, key_id: str) -> dict[str, str]:
        with self.r() as r:
            return r.hgetall("{vk:" + key_id + "}:key")  # type: ignore[return-value]

    def one_record(self, key_id: str) -> dict[str, str]:
        wait_until(lambda: self.records(key_id), 10, 0.05)
        (record,) = self.records(key_id)
        f = self.key(key_id)
        assert f["reserved"] == "0" and int(f["spent"]) == int(record["cost_micro_usd"])
        return record


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    workdir = tmp_path_factory.mktemp("chaos")
    redis_server = start_redis(workdir / "redis")
    backends = {"slow": start_backend(workdir, "slow", "--tokens-per-chunk", "3"),
                "bulky": start_backend(workdir, "bulky", "--tokens-per-chunk", "40", "--delay", "0.05"),
                "mute": start_backend(workdir, "mute", "--tokens-per-chunk", "3", "--no-usage")}
    chaos: Chaos | None = None
    try:
        with running_stack(workdir, redis_server, FAST) as stack:
            for name, (_proc, url) in backends.items():
                stack.register(name, engine="vllm-server", base_url=url, project="chaos")
            stack.register("echo-c", engine="echo", project="chaos")
            for model in MODELS:
                out = stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1", "--output-per-mtok", "2")
                assert out.returncode == 0, out.stderr
            chaos = Chaos(stack, redis_server, backends)
            wait_until(lambda: _ready(stack), 60)
            yield chaos
    finally:
        for proc, _url in backends.values():
            proc.stop()
        redis_server.proc.stop()
        if chaos is not None:  # a test restarts Redis: the fixture stops the one running now
            chaos.redis_server.proc.stop()


def _ready(stack: Stack) -> bool:
    models = {m["id"] for m in httpx.get(stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]}
    prices = {p["model"] for p in httpx.get(stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]}
    return set(MODELS) <= models and set(MODELS) <= prices


def _words(chunks: list[Any]) -> int:
    return len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split())


def _stream(c: openai.OpenAI, model: str, max_tokens: int = 2000) -> Any:
    return c.chat.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                     messages=[{"role": "user", "content": "go"}])


def test_backend_killed_mid_stream_gives_an_sse_error_and_bills_what_was_delivered(chaos: Chaos) -> None:
    row = chaos.issue(budget_usd=1)
    c = chaos.client(row["virtual_key"])
    complete = list(_stream(c, "slow", max_tokens=5))  # the client asked for no usage: it sees none
    assert _words(complete) == 5 and all(ch.usage is None for ch in complete)
    assert chaos.one_record(row["id"])["completion_tokens"] == "5"

    row = chaos.issue(budget_usd=1)
    c = chaos.client(row["virtual_key"])
    chunks: list[Any] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in _stream(c, "slow"):
            chunks.append(chunk)
            if len(chunks) == 6:
                chaos.backends["slow"][0].stop(signal.SIGKILL)
    assert "AllBackendsFailed" in str(info.value.body) or "endpoint:slow" in info.value.message
    record = chaos.one_record(row["id"])
    assert record["status"] == "502" and record["estimated"] == "0"
    # billed what the client got, as the engine counted it (3 tokens a chunk), not one per chunk
    assert int(record["completion_tokens"]) == _words(chunks) >= 15
    assert int(record["cost_micro_usd"]) == 7 + 2 * _words(chunks)
    chaos.backends["slow"] = start_backend(chaos.stack.workdir, "slow-2", "--tokens-per-chunk", "3")
    chaos.stack.register("slow", engine="vllm-server", base_url=chaos.backends["slow"][1], project="chaos")


def test_client_cut_stream_is_billed_the_tokens_delivered_not_the_chunks(chaos: Chaos) -> None:
    row = chaos.issue(budget_usd=1)
    stream = _stream(chaos.client(row["virtual_key"]), "bulky")
    got = [next(stream) for _ in range(4)]  # 40 tokens a chunk
    stream.close()
    record = chaos.one_record(row["id"])
    assert record["status"] == "499" and record["estimated"] == "0"
    assert 120 <= _words(got) <= int(record["completion_tokens"]) < 2000


def test_stream_without_engine_usage_is_billed_a_bound_of_the_text_sent(chaos: Chaos) -> None:
    row = chaos.issue(budget_usd=1)
    stream = _stream(chaos.client(row["virtual_key"]), "mute")
    got = [next(stream) for _ in range(8)]
    stream.close()
    record = chaos.one_record(row["id"])
    assert record["status"] == "499" and record["estimated"] == "1"
    assert int(record["completion_tokens"]) >= _words(got) >= 21  # never less than delivered


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_client_disconnect_aborts_the_engine_generation_and_settles(chaos: Chaos) -> None:
    url = chaos.backends["bulky"][1]
    row = chaos.issue(budget_usd=1)
    stream = _stream(chaos.client(row["virtual_key"]), "bulky", max_tokens=20_000)  # ~25 s if not aborted
    next(stream)
    assert _running(url) == 1
    stream.close()
    wait_until(lambda: _running(url) == 0, 10, 0.05)
    assert chaos.one_record(row["id"])["status"] == "499"


def test_mediaguard_down_means_media_is_refused_never_forwarded(chaos: Chaos) -> None:
    stack = chaos.stack
    server = RecordingServer()
    try:
        block = {"engine": "vllm", "hf_model_id": "org/vl", "multimodal": {
            "modality": "vision", "limit_mm_per_prompt": {"image": 2}, "allowed_media_domains": ["example.com"]}}
        stack.register("vision-c", engine="vllm-server", base_url=server.url, engine_block_json=json.dumps(block))
        c = chaos.client()
        image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                              {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
        wait_until(lambda: _status(c, "vision-c", image) == 200, 10)
        stack.stop("mediaguard", signal.SIGKILL)
        server.bodies.clear()
        try:
            status = _status(c, "vision-c", image)
            assert status >= 500 and server.bodies == []  # refused, and the engine received nothing
            assert _status(c, "vision-c", [{"role": "user", "content": "text needs no guard"}]) == 200
        finally:
            stack.start("mediaguard")
        wait_until(lambda: _status(c, "vision-c", image) == 200, 15, 0.1)
    finally:
        server.close()


def _status(c: openai.OpenAI, model: str, messages: Any) -> int:
    try:
        c.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError as exc:
        return exc.status_code
    except openai.APIConnectionError:
        return 0
    return 200


def test_engine_proxy_restart_the_gateway_recovers(chaos: Chaos) -> None:
    c = chaos.client()
    msg = [{"role": "user", "content": "still there"}]
    assert _status(c, "echo-c", msg) == 200
    chaos.stack.stop("engine-proxy", signal.SIGKILL)
    assert _status(c, "echo-c", msg) in (502, 503)
    started = time.monotonic()
    chaos.stack.start("engine-proxy")
    up = time.monotonic()
    wait_until(lambda: _status(c, "echo-c", msg) == 200, 30, 0.02)
    print(f"\nengine-proxy restart: serving {up - started:.2f} s after start; gateway calls succeed again "
          f"{time.monotonic() - up:.3f} s after it serves")


def test_idle_and_slow_loris_connections_do_not_stop_normal_calls(chaos: Chaos) -> None:
    port = int(chaos.stack.gateway_url.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    try:
        for i in range(500):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:  # a slow loris: a request head that never ends
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nX-a: ")
            socks.append(s)
        c = chaos.client()
        for i in range(10):
            resp = c.chat.completions.create(model="echo-c", messages=[{"role": "user", "content": f"ping {i}"}])
            assert resp.choices[0].message.content == f"echo: ping {i}"
        for s in socks[1::2][:50]:
            s.sendall(b"a")  # still trickling
        assert _status(c, "echo-c", [{"role": "user", "content": "after"}]) == 200
    finally:
        for s in socks:
            s.close()


def test_redis_killed_and_restarted_under_load_loses_nothing_acknowledged(chaos: Chaos) -> None:
    stack, server = chaos.stack, chaos.redis_server
    row = chaos.issue(budget_usd=1)
    vk = chaos.client(row["virtual_key"])
    admin = chaos.client()
    acked: list[str] = []       # keys whose issue was acknowledged (201)
    calls = {"ok": 0}           # virtual-key calls answered 200
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                acked.append(chaos.issue()["id"])
            except (AssertionError, httpx.HTTPError):
                pass
            if _status(vk, "echo-c", [{"role": "user", "content": "load"}]) == 200:
                calls["ok"] += 1
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    # a stream in flight when Redis dies ends while it is down: its settle must land once it is back
    in_flight = _stream(vk, "slow", max_tokens=60)
    first = next(in_flight)
    wait_until(lambda: len(acked) >= 5 and calls["ok"] >= 5, 20, 0.05)
    server.proc.stop(signal.SIGKILL)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            vk.chat.completions.create(model="echo-c", messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 503 and isinstance(info.value.body, dict)
        assert info.value.body["code"] == "governance_unavailable"
        assert _status(admin, "echo-c", [{"role": "user", "content": "admin flows"}]) == 200
        assert _words([first, *list(in_flight)]) == 60  # the stream ends while Redis is down
    finally:
        stop.set()
        worker.join(30)
        chaos.redis_server = start_redis(server.dir, server.port)
    with chaos.r() as r:
        assert all(r.sismember("{exa:gw}:keys", key_id) for key_id in acked)
        audited = {e.split(":", 1)[1] for e in _audit_targets(stack)}
        assert set(acked) <= audited
    wait_until(lambda: sum(1 for rec in chaos.records(row["id"]) if rec["status"] == "200") >= calls["ok"] + 1, 60)
    f = chaos.key(row["id"])
    records = chaos.records(row["id"])
    assert [rec for rec in records if rec["status"] == "reaped"] == []
    streamed_rec = [rec for rec in records if rec["completion_tokens"] == "60"]
    assert len(streamed_rec) == 1 and streamed_rec[0]["late"] == "0"  # the stream's real cost, charged once
    assert sum(int(rec["cost_micro_usd"]) for rec in records) == int(f["spent"])
    wait_until(lambda: chaos.key(row["id"])["reserved"] == "0", 60)


def _audit_targets(stack: Stack) -> list[str]:
    out = stack.cli("--json", "audit", "list", "--action", "key.issue", "--limit", "10000")
    assert out.returncode == 0, out.stderr
    return [e["target"] for e in json.loads(out.stdout) if e["action"] == "key.issue"]
