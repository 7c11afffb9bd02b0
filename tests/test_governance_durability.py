"""The governance store (the gateway's own Redis, appendfsync everysec) killed with SIGKILL under load.

Two real Redis processes as `make up` runs them (the registry's on appendfsync always, the gateway's
on everysec), the five services, the fast stub backend, and 24 threads of the official openai client
on four virtual keys (one budget tight enough to refuse calls), streamed and not. The gateway's Redis
is SIGKILLed mid-load and restarted on its AOF; what GOVERNANCE.md ("Durability") promises is then
checked in Redis and in the gateway's /metrics: every key and its settings are back, each key's spend
is the sum of its cost records and within its budget, every settle the gateway acknowledged
(`examlops_gateway_calls_total`, by the key's project) has its record, calls during the outage got a
503 `governance_unavailable` and nothing else, and calls succeed again after the restart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc, free_port, spawn, wait_http
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis, wait_until

FAST = {"EXAMLOPS_PRICE_REFRESH_S": "0.2", "EXAMLOPS_HEARTBEAT_S": "0.2", "EXAMLOPS_REPLICA_TTL_S": "1",
        "EXAMLOPS_REAPER_INTERVAL_S": "0.5"}
ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
STUB = Path(__file__).resolve().parents[1] / "bench" / "stub_backend.py"
MODEL = "stub"
SLOW = "slow"   # the stream backend: 10 chunks, 0.1 s apart
CLIENTS = 24
#: (project, budget USD): one key refuses calls within the test, three are far from their budgets
KEYS = [("dur-tight", 0.0015), ("dur-a", 50.0), ("dur-b", 50.0), ("dur-c", None)]


class World:
    def __init__(self, stack: Stack, gov: RedisServer) -> None:
        self.stack, self.gov = stack, gov
        self.keys: list[dict[str, Any]] = []

    def issue(self, project: str, budget: float | None) -> dict[str, Any]:
        body: dict[str, Any] = {"tenant": "dur", "project": project, "models": [MODEL, SLOW], "rpm": 100_000}
        if budget is not None:
            body["budget_usd"] = budget
        resp = httpx.post(self.stack.gateway_url + "/admin/keys", headers=ADMIN, json=body, timeout=10)
        assert resp.status_code == 201, resp.text
        row: dict[str, Any] = resp.json()
        return row

    def key(self, key_id: str) -> dict[str, str]:
        with self.gov.client() as r:
            return r.hgetall("{vk:" + key_id + "}:key")  # type: ignore[return-value]

    def records(self, key_id: str) -> list[dict[str, str]]:
        with self.gov.client() as r:
            return [f for _id, f in r.xrange("{vk:" + key_id + "}:cost")]  # type: ignore[union-attr]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.stack.gateway_url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in self.metrics().items()
                   if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("durability")
    registry_redis = start_redis(workdir / "redis")
    gov = start_redis(workdir / "gateway-redis", fsync="everysec")
    port = free_port()
    stub: Proc = spawn("stub", [sys.executable, str(STUB), "--port", str(port)], {}, workdir / "stub.log")
    slow_port = free_port()
    slow = spawn("slow", [sys.executable, "-m", "examlops_testsupport.stream_backend", "--port", str(slow_port),
                          "--tokens-per-chunk", "2", "--delay", "0.1"], {}, workdir / "slow.log")
    worlds: list[World] = []
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 15, stub)
        wait_http(f"http://127.0.0.1:{slow_port}/metrics", 15, slow)
        with running_stack(workdir, registry_redis, FAST, gateway_redis=gov) as stack:
            stack.register(MODEL, engine="vllm-server", base_url=f"http://127.0.0.1:{port}")
            stack.register(SLOW, engine="vllm-server", base_url=f"http://127.0.0.1:{slow_port}")
            for model in (MODEL, SLOW):
                out = stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1", "--output-per-mtok", "2")
                assert out.returncode == 0, out.stderr
            wait_until(lambda: {MODEL, SLOW} <= {p["model"] for p in httpx.get(
                stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]}, 15)
            worlds.append(World(stack, gov))
            yield worlds[0]
    finally:
        stub.stop()
        slow.stop()
        for server in {id(s): s for s in [gov, *(w.gov for w in worlds)]}.values():
            server.proc.stop()  # the restarted one too
        registry_redis.proc.stop()


class Load:
    """CLIENTS threads, each on one key, alternating streamed and non-streamed calls, tallying outcomes."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok: Counter[str] = Counter()          # project -> 200 answers, whole streams included
        self.outcomes: Counter[str] = Counter()    # "200", "429 budget_exceeded", "503 governance_unavailable", ...
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _call(self, client: openai.OpenAI, stream: bool) -> None:
        messages = [{"role": "user", "content": "How durable is the spend?"}]
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                         max_tokens=16, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)  # type: ignore[arg-type]
            assert resp.choices[0].message.content

    def _run(self, i: int) -> None:
        row = self.w.keys[i % len(self.w.keys)]
        client = openai.OpenAI(base_url=self.w.stack.gateway_url + "/v1", api_key=row["virtual_key"],
                               max_retries=0, timeout=20)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self._call(client, stream=bool((n + i) % 2))
                outcome = "200"
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                outcome = f"{exc.status_code} {body.get('code')}"
            except Exception as exc:  # a hang (timeout), a cut connection: what must never happen
                outcome = f"error {type(exc).__name__}: {exc}"
            with self.lock:
                self.outcomes[outcome] += 1
                if outcome == "200":
                    self.ok[row["project"]] += 1
            if outcome != "200":
                self.stop.wait(0.02)
        client.close()

    def count(self, outcome: str) -> int:
        with self.lock:
            return self.outcomes[outcome]


def test_sigkill_of_the_governance_redis_under_load_loses_no_acknowledged_spend(world: World) -> None:
    w = world
    w.keys = [w.issue(project, budget) for project, budget in KEYS]
    settings = {row["id"]: {f: w.key(row["id"])[f] for f in ("hash", "project", "budget", "models", "rpm")}
                for row in w.keys}
    assert w.metric("examlops_gateway_governance_store_aof_enabled") == 1
    load = Load(w)
    for t in load.threads:
        t.start()
    try:
        wait_until(lambda: load.count("200") >= 150 and load.count("429 budget_exceeded") >= 1, 60, 0.05,
                   "the load runs and the tight key refuses calls")
        w.gov.proc.stop(signal.SIGKILL)
        down_at = load.count("503 governance_unavailable")
        wait_until(lambda: load.count("503 governance_unavailable") >= down_at + CLIENTS, 30, 0.02,
                   "calls during the outage get 503 governance_unavailable")
        w.gov = start_redis(w.gov.dir, w.gov.port, fsync="everysec")  # the same AOF
        ok_at = load.count("200")
        wait_until(lambda: load.count("200") >= ok_at + 150, 60, 0.05, "calls succeed after the restart")
    finally:
        load.stop.set()
        for t in load.threads:
            t.join(60)
    assert not any(t.is_alive() for t in load.threads), "a client hung"
    allowed = {"200", "429 budget_exceeded", "503 governance_unavailable"}
    assert set(load.outcomes) <= allowed, load.outcomes

    # Every settle, retried ones included, has landed once nothing is reserved any more.
    wait_until(lambda: all(w.key(row["id"])["reserved"] == "0" for row in w.keys), 30, 0.1, "every call settled")
    records = {row["id"]: w.records(row["id"]) for row in w.keys}
    unmatched = w.metric("examlops_gateway_settles_unmatched_total")
    counted = 0.0
    for row in w.keys:
        f, recs = w.key(row["id"]), records[row["id"]]
        assert {k: f[k] for k in settings[row["id"]]} == settings[row["id"]]  # the key and its settings survived
        assert int(f["spent"]) == sum(int(r["cost_micro_usd"]) for r in recs)
        if int(f["budget"]) >= 0:
            assert int(f["spent"]) <= int(f["budget"]), (row["project"], f["spent"], f["budget"])
        # every settle the gateway acknowledged has its record: none lost
        acked = w.metric("examlops_gateway_calls_total", project=row["project"])
        assert acked <= len(recs), (row["project"], acked, len(recs))
        assert [r for r in recs if r["status"] == "reaped"] == []
        counted += acked
    # a record the gateway did not count is a settle whose reply was lost and whose retry answered duplicate
    everything = sum(len(recs) for recs in records.values())
    assert everything - unmatched <= counted <= everything, (everything, counted, unmatched)
    billed = sum(1 for recs in records.values() for r in recs if r["status"] == "200")
    # every 200 a client got is billed, but a call whose reservation the restart lost (counted unmatched)
    assert billed <= sum(load.ok.values()) <= billed + unmatched, (billed, load.ok, unmatched)
    assert w.key(w.keys[0]["id"])["spent"] != "0" and load.count("429 budget_exceeded") >= 1

    # After the restart: new calls succeed, the store's gauges are served.
    client = openai.OpenAI(base_url=w.stack.gateway_url + "/v1", api_key=w.keys[1]["virtual_key"], max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "after"}], max_tokens=4)
    assert resp.choices[0].message.content
    assert w.metric("examlops_gateway_governance_store_aof_enabled") == 1
    assert ("examlops_gateway_governance_store_aof_delayed_fsync", ()) in w.metrics()
    recovered = w.metric("examlops_gateway_settles_replayed_total", outcome="recovered")
    kept = w.metric("examlops_gateway_settles_replayed_total", outcome="kept")
    print(f"outcomes {dict(load.outcomes)}; settles re-sent after the restart: {recovered:g} recovered "
          f"(the store had lost them), {kept:g} kept; unmatched {unmatched:g}")


def test_a_settle_the_restarted_store_lost_is_sent_again_and_charged_once(world: World) -> None:
    """What a SIGKILL during a held-back write does, made certain: the store comes back from an AOF
    copied while a stream ran (its reservation in it, its settle not), and the gateway re-sends the
    settle it had acknowledged."""
    w = world
    row = w.issue("dur-lost", 50.0)
    key_id = row["id"]
    client = openai.OpenAI(base_url=w.stack.gateway_url + "/v1", api_key=row["virtual_key"], max_retries=0)
    streamed: list[str] = []
    stream = threading.Thread(target=lambda: streamed.extend(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=SLOW, max_tokens=20, stream=True, messages=[{"role": "user", "content": "go"}]) if c.choices))
    stream.start()
    aof = w.gov.dir / "appendonlydir"

    def reserved_on_file() -> bool:
        with w.gov.client() as r:
            open_ = [f for f in r.hkeys("{vk:" + key_id + "}:res") if ":" not in f]  # type: ignore[union-attr]
        return bool(open_) and all(any(f.encode() in p.read_bytes() for p in aof.iterdir()) for f in open_)
    wait_until(reserved_on_file, 10, 0.01, "the stream's reservation is in the AOF")
    copy = w.gov.dir.parent / "aof-during-the-stream"
    shutil.copytree(aof, copy)
    stream.join(30)
    assert len("".join(streamed).split()) == 20
    wait_until(lambda: w.records(key_id), 10, 0.05, "the stream settled")
    recovered = w.metric("examlops_gateway_settles_replayed_total", outcome="recovered")

    w.gov.proc.stop(signal.SIGKILL)
    shutil.rmtree(aof)
    shutil.copytree(copy, aof)
    w.gov = start_redis(w.gov.dir, w.gov.port, fsync="everysec")
    # The store is back without the settle (the replica may re-send it within a heartbeat): "recovered"
    # says the settle found its reservation open again, as a settle held back by the crash would.
    wait_until(lambda: w.metric("examlops_gateway_settles_replayed_total", outcome="recovered") >= recovered + 1,
               15, 0.05, "the lost settle is sent again")
    (record,) = w.records(key_id)
    f = w.key(key_id)
    assert record["completion_tokens"] == "20" and record["late"] == "0"
    assert f["reserved"] == "0" and int(f["spent"]) == int(record["cost_micro_usd"]) > 0


def test_a_bad_gateway_redis_url_stops_the_gateway_naming_that_setting(world: World) -> None:
    """The gateway's own Redis URL is its own setting: its errors name EXAMLOPS_GATEWAY_REDIS_URL
    (not the registry's EXAMLOPS_REDIS_URL), and never print the password."""
    base = {**os.environ, **world.stack.env("gateway"), "EXAMLOPS_PORT": "0"}
    for url, says in (("redis://:hunter2-secret@127.0.0.1:notaport/0", "EXAMLOPS_GATEWAY_REDIS_URL: "),
                      (f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0", "EXAMLOPS_GATEWAY_REDIS_URL=")):
        env = {**base, "EXAMLOPS_GATEWAY_REDIS_URL": url}
        out = subprocess.run([sys.executable, "-m", "examlops_gateway"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0
        assert says in out.stderr and "EXAMLOPS_REDIS_URL" not in out.stderr, out.stderr[-2000:]
        assert "hunter2-secret" not in out.stderr + out.stdout
