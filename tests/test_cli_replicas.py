"""`exa serve llm` on pools of replicas, as an operator runs it, against the real services and stub servers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from examlops_devstack import Proc, free_port, spawn, wait_http
from examlops_testsupport.fixtures import Stack, wait_until

STUB = Path(__file__).resolve().parents[1] / "bench" / "stub_backend.py"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Three fast OpenAI-compatible stub servers (bench/stub_backend.py), each its own process."""
    workdir = tmp_path_factory.mktemp("stubs")
    procs: list[Proc] = []
    urls = []
    try:
        for i in range(3):
            port = free_port()
            procs.append(spawn(f"stub{i}", [sys.executable, str(STUB), "--port", str(port)], {},
                               workdir / f"stub{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health", 15, procs[-1])
        yield urls
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A slow streaming server whose /metrics reports vllm:num_requests_running (stream_backend)."""
    port = free_port()
    proc = spawn("metered", [sys.executable, "-m", "examlops_testsupport.stream_backend", "--port", str(port),
                             "--delay", "0.05"], {}, tmp_path_factory.mktemp("metered") / "metered.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", 15, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def exa_json(stack: Stack, *args: str) -> Any:
    out = stack.cli("--json", *args)
    assert out.returncode == 0, (args, out.stderr)
    return json.loads(out.stdout)


def listed(stack: Stack, name: str) -> dict[str, Any]:
    return next(e for e in exa_json(stack, "serve", "llm", "list") if e["name"] == name)


def start_pool(stack: Stack, name: str, urls: list[str], *flags: str) -> dict[str, Any]:
    args = [a for url in urls for a in ("--base-url", url)]
    ep: dict[str, Any] = exa_json(stack, "serve", "llm", "start", name, *args, *flags)
    assert stack.cli("serve", "llm", "health", name).returncode == 0
    return ep


def test_start_an_external_pool_with_prefix_routing_and_list_it(stack: Stack, stubs: list[str]) -> None:
    ep = start_pool(stack, "pool-list", stubs[:2], "--routing", "prefix")
    assert ep["engine_block"]["routing"] == "prefix" and "hf_model_id" not in ep["engine_block"]
    assert [(r["id"], r["base_url"]) for r in ep["replicas"]] == [("r0", stubs[0]), ("r1", stubs[1])]

    row = listed(stack, "pool-list")
    assert row["state"] == "READY" and row["base_url"] == stubs[0]
    for r in row["replicas"]:
        assert r["state"] == "READY" and r["source"] == "external" and r["draining"] is False
        assert isinstance(r["last_health_ms"], int) and r["last_health_ms"] > 0
        assert set(r) == {"id", "base_url", "state", "source", "job_id", "draining", "state_reason",
                          "last_health_ms"}
    table = stack.cli("serve", "llm", "list").stdout
    line = next(x for x in table.splitlines() if "pool-list" in x)
    assert "2/2" in line and "READY" in line

    one = exa_json(stack, "serve", "llm", "start", "pool-one", "--base-url", stubs[2])
    assert [r["id"] for r in one["replicas"]] == ["r0"] and one["base_url"] == stubs[2]


def test_replica_add_and_remove_change_the_live_pool(stack: Stack, stubs: list[str]) -> None:
    start_pool(stack, "pool-edit", stubs[:2])
    added = stack.cli("serve", "llm", "replica", "add", "pool-edit", "--base-url", stubs[2])
    assert added.returncode == 0, added.stderr
    assert stubs[2] in added.stdout and "r2" in added.stdout
    assert [r["base_url"] for r in listed(stack, "pool-edit")["replicas"]] == stubs

    preview = exa_json(stack, "serve", "llm", "replica", "remove", "pool-edit", "r1", "--dry-run")
    assert preview["dry_run"] is True and preview["changes"]
    assert len(listed(stack, "pool-edit")["replicas"]) == 3  # a dry run changes nothing

    removed = stack.cli("serve", "llm", "replica", "remove", "pool-edit", stubs[2], "--drain-timeout", "5")
    assert removed.returncode == 0, removed.stderr
    assert "r2" in removed.stdout
    pool = listed(stack, "pool-edit")["replicas"]
    assert [r["id"] for r in pool] == ["r0", "r1"]

    gone = stack.cli("serve", "llm", "replica", "remove", "pool-edit", "r9")
    assert gone.returncode == 1 and "r9" in gone.stderr and len(gone.stderr.strip().splitlines()) == 1


def test_scale_an_external_pool_refuses_growth_and_names_replica_add(stack: Stack, stubs: list[str]) -> None:
    start_pool(stack, "pool-scale", stubs[:2])
    grow = stack.cli("serve", "llm", "scale", "pool-scale", "3")
    assert grow.returncode == 1 and "replica add" in grow.stderr, grow.stderr
    assert "Traceback" not in grow.stderr and len(grow.stderr.strip().splitlines()) == 1

    shrink = stack.cli("serve", "llm", "scale", "pool-scale", "1", "--drain-timeout", "5")
    assert shrink.returncode == 0, shrink.stderr
    assert [r["id"] for r in listed(stack, "pool-scale")["replicas"]] == ["r0"]


def test_a_change_that_runs_a_job_asks_first(stack: Stack, stubs: list[str]) -> None:
    block = {"engine": "vllm-server", "hf_model_id": "org/m", "served_model_name": "pool-hpc"}
    stack.register("pool-hpc", launcher="slurm", job_id="4242", base_url=stubs[0], engine_block_json=json.dumps(block))
    preview = stack.cli("serve", "llm", "scale", "pool-hpc", "2", "--dry-run")
    assert preview.returncode == 0 and "sbatch" in preview.stdout and "nothing was changed" in preview.stdout

    asked = stack.cli("serve", "llm", "scale", "pool-hpc", "2")  # no terminal answers: cancelled
    assert asked.returncode == 1 and "Proceed?" in asked.stdout and "pass --yes" in asked.stderr
    assert [r["id"] for r in listed(stack, "pool-hpc")["replicas"]] == ["r0"]

    # A server someone else runs leaves the pool without a question: no job of ours stops.
    assert stack.cli("serve", "llm", "replica", "add", "pool-hpc", "--base-url", stubs[1]).returncode == 0
    out = stack.cli("serve", "llm", "replica", "remove", "pool-hpc", stubs[1], "--drain-timeout", "1")
    assert out.returncode == 0 and "Proceed?" not in out.stdout, out.stderr
    assert [r["id"] for r in listed(stack, "pool-hpc")["replicas"]] == ["r0"]


def test_status_shows_each_replica_and_engine_proxys_routing(stack: Stack, stubs: list[str]) -> None:
    start_pool(stack, "pool-status", stubs[:2], "--routing", "round-robin")
    wait_until(lambda: len((exa_json(stack, "serve", "llm", "status", "pool-status")["routing"] or {})
                           .get("replicas", [])) == 2, timeout_s=10, what="engine-proxy holds both replicas")
    for i in range(4):
        assert stack.cli("serve", "llm", "chat", "pool-status", "-m", f"hi {i}").returncode == 0

    st = exa_json(stack, "serve", "llm", "status", "pool-status")
    assert [(r["id"], r["base_url"], r["source"]) for r in st["replicas"]] == [
        ("r0", stubs[0], "external"), ("r1", stubs[1], "external")]
    assert st["routing"]["policy"] == "round-robin"
    stats = {s["id"]: s for s in st["routing"]["replicas"]}
    assert set(stats) == {"r0", "r1"} and all(s["healthy"] for s in stats.values())
    assert sum(s["requests"] for s in stats.values()) == 4
    assert all(s["picks"].get("round-robin") == 2 for s in stats.values()), stats

    human = stack.cli("serve", "llm", "status", "pool-status").stdout
    assert "Replicas (2/2 ready)" in human and "Routing (engine-proxy): round-robin" in human
    assert "round-robin=2" in human and stubs[1] in human

    blind = stack.cli("serve", "llm", "status", "pool-status",
                      env={"EXAMLOPS_ENGINE_PROXY_ADDR": f"127.0.0.1:{free_port()}"})
    assert blind.returncode == 0, blind.stderr
    assert "cannot reach engine-proxy" in blind.stdout and "Replicas (2/2 ready)" in blind.stdout


def test_status_shows_each_replicas_live_load(stack: Stack, stubs: list[str], metered: str) -> None:
    start_pool(stack, "pool-load", [stubs[2], metered])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", metered + "/v1/chat/completions", json=body, timeout=30) as generating:
        chunks = generating.iter_bytes()  # held: dropping the iterator would close the stream
        next(chunks)  # one request is running on r1 while status reads the pool
        st = exa_json(stack, "serve", "llm", "status", "pool-load")
        human = stack.cli("serve", "llm", "status", "pool-load").stdout
    load = {r["id"]: r["metrics"] for r in st["replicas"]}
    assert load["r1"]["requests_running"] == 1 and "requests_running" not in load["r0"]  # the stub has no /metrics
    replicas_table = human.split("Replicas (")[1].split("Routing (")[0]
    rows = {cells[1]: cells for line in replicas_table.splitlines()
            if len(cells := [c.strip() for c in line.split("│")]) > 5 and cells[1] in ("r0", "r1")}
    assert rows["r1"][2:5] == ["READY", metered, "1"] and rows["r0"][2:5] == ["READY", stubs[2], "-"]


def test_pool_flags_are_checked_before_anything_is_sent(stack: Stack, stubs: list[str]) -> None:
    a, b = stubs[:2]
    cases = [
        (["start", "p", "--base-url", a, "--base-url", a], "given twice"),
        (["start", "p", "--base-url", a, "--base-url", b, "--replicas", "3"], "one --base-url per replica"),
        (["start", "p", "--base-url", a, "--routing", "fastest"], "least-load, prefix, session, round-robin"),
        (["start", "p", "--launcher", "slurm", "--base-url", a, "--base-url", b], "use --replicas N"),
        (["start", "p", "--replicas", "0"], "at least 1"),
        (["scale", "p", "0"], "exa serve llm stop p"),
        (["replica", "add", "p", "--base-url", "ftp://x"], "not an http(s) URL"),
        (["scale", "nope", "2"], "nope"),
    ]
    for args, expected in cases:
        out = stack.cli("serve", "llm", *args)
        assert out.returncode == 1 and expected in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr
    assert "p" not in {e["name"] for e in exa_json(stack, "serve", "llm", "list")}


def test_help_explains_pools() -> None:
    import subprocess

    exa = Path(sys.executable).parent / "exa"

    def helptext(*args: str) -> str:
        out = subprocess.run([str(exa), "serve", "llm", *args, "--help"], capture_output=True, text=True,
                             timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        return " ".join(out.stdout.split())

    start = helptext("start")
    assert "repeat it once per replica" in start and "least-load | prefix | session | round-robin" in start
    assert "replica add" in helptext("scale") and "--drain-timeout" in helptext("scale")
    assert "in-flight ones finish" in helptext("replica", "remove") and "r1" in helptext("replica", "remove")
    assert "running OpenAI-compatible server" in helptext("replica", "add")
    assert "ready/total" in helptext("list") and "routing" in helptext("status")


def test_an_address_with_a_password_is_refused_naming_the_fix_and_never_echoed(stack: Stack, stubs: list[str]) -> None:
    secret = "s3cret-pw"
    url = stubs[0].replace("http://", f"http://ops:{secret}@")
    start_pool(stack, "pool-creds", stubs[1:2])
    for args in (("start", "pool-creds-new", "--base-url", url), ("replica", "add", "pool-creds", "--base-url", url)):
        for fmt in ((), ("--json",)):
            out = stack.cli(*fmt, "serve", "llm", *args)
            assert out.returncode != 0 and "carries credentials; use api_key_secret_ref" in out.stderr, out.stderr
            assert secret not in out.stdout + out.stderr and "ops:***@" in out.stderr
    assert "pool-creds-new" not in [e["name"] for e in exa_json(stack, "serve", "llm", "list")]
    assert [r["base_url"] for r in listed(stack, "pool-creds")["replicas"]] == stubs[1:2]
