"""The pieces of `make bench-peers` that run cheaply: the plain pass-through proxy, the load generator's
TTFT, pinning, and the results files. LiteLLM itself is exercised by `make bench-peers` only (its
install takes minutes)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_gateway as bg  # noqa: E402
import peers_report as pr  # noqa: E402
import peers_targets as pt  # noqa: E402

from examlops_devstack import Proc, free_port, spawn, wait_http  # noqa: E402


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str]]:
    port = free_port()
    proc = spawn("stub", [sys.executable, str(ROOT / "bench" / "stub_backend.py"), "--port", str(port)], {},
                 tmp_path_factory.mktemp("stub") / "stub.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 15, proc)
        yield proc, url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def plain_proxy(stub: tuple[Proc, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = pt.start_plain_proxy(stub[1], tmp_path_factory.mktemp("plain") / "plain.log")
    try:
        yield url
    finally:
        proc.stop()


def _raw_answers(base_url: str) -> tuple[bytes, bytes]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        whole = client.chat.completions.with_raw_response.create(
            model=bg.ENDPOINT, messages=bg.MESSAGES)  # type: ignore[arg-type]
        assert whole.parse().choices[0].message.content == bg.STUB_TEXT
        with client.chat.completions.with_streaming_response.create(
                model=bg.ENDPOINT, messages=bg.MESSAGES, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = b"".join(streamed.iter_bytes())
        return whole.http_response.content, events
    finally:
        client.close()


def test_the_plain_proxy_passes_both_answers_through_unchanged(stub: tuple[Proc, str], plain_proxy: str) -> None:
    direct_whole, direct_events = _raw_answers(stub[1])
    whole, events = _raw_answers(plain_proxy)
    assert whole == direct_whole
    assert events == direct_events
    assert events.count(b"data: ") == 9 and events.endswith(b"data: [DONE]\n\n")  # 8 chunks and [DONE]
    # and the official client reads the proxied stream as the stub's
    client = openai.OpenAI(base_url=plain_proxy + "/v1", api_key="unused", max_retries=0, timeout=10)
    chunks = list(client.chat.completions.create(model=bg.ENDPOINT, messages=bg.MESSAGES,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    client.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bg.STUB_TEXT
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_the_load_generator_reports_ttft_for_streams_only(stub: tuple[Proc, str]) -> None:
    proc, url = stub
    loadgen = bg.LoadGen()
    try:
        results = {}
        for stream in (True, False):
            results[stream] = loadgen.chat(url, "unused", stream, 2, (40, 4, 20), {"stub": proc.pid}, url)
    finally:
        loadgen.close()
    streamed, whole = results[True], results[False]
    for res in (streamed, whole):  # the fields the other benchmarks read are all still there
        assert res["count"] == 40 and res["errors"] == 0
        assert {"rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "elapsed_s", "cpu_ms_per_request"} <= set(res)
    assert 0 < streamed["ttft_p50_ms"] <= streamed["ttft_p90_ms"] <= streamed["ttft_p99_ms"]
    assert streamed["ttft_p50_ms"] <= streamed["max_ms"]
    assert whole["ttft_p50_ms"] is None and whole["ttft_p99_ms"] is None


@pytest.mark.skipif(pt.pin_cpus() is None, reason="needs taskset and two CPUs")
def test_pin_moves_every_thread_of_a_process_tree(tmp_path: Path) -> None:
    # a parent with a child, as uvicorn's workers or LiteLLM's server are
    parent = spawn("tree", [sys.executable, "-c", "import subprocess, sys, time; "
                            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                            "time.sleep(60)"], {}, tmp_path / "tree.log")
    try:
        deadline = time.monotonic() + 10
        while len(pt.process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        cpu = pt.pin_cpus()[1]  # type: ignore[index]
        tree = pt.pin(parent.pid, cpu)
        assert len(tree) == 2
        for pid in tree:
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {cpu}
        with pytest.raises(RuntimeError, match="could not pin"):
            pt.pin(parent.pid, max(os.sched_getaffinity(0)) + 64)  # a CPU this machine does not have
    finally:
        parent.stop()


def _result(p50: float, p99: float, rps: float, ttft: float | None) -> dict[str, Any]:
    return {"count": 100, "errors": 0, "first_error": "", "p50_ms": p50, "p99_ms": p99, "rps": rps,
            "ttft_p50_ms": ttft}


def _round(latency: dict[str, float], rps: dict[str, float], stream: bool, clients: int) -> dict[str, Any]:
    ttft = (lambda t: latency[t] / 2) if stream else (lambda _t: None)
    return {t: _result(latency[t], latency[t] * 2 if clients == 1 else latency[t] * 3, rps[t], ttft(t))
            for t in latency}


def test_the_results_files_hold_the_table_the_targets_and_the_machine(tmp_path: Path) -> None:
    latency = {"direct": 0.05, "plain": 1.05, "admin": 1.55, "governed": 2.05, "litellm": 14.05}
    rps = {"direct": 20000.0, "plain": 500.0, "admin": 800.0, "governed": 650.0, "litellm": 100.0}
    raw = {point: [_round(latency, rps, stream, clients) for _ in range(2)]
           for point, (stream, clients) in pr.POINTS.items()}
    machine = pt.machine_description("1.110.2", {"CPU 0": "gateway, engine-proxy", "CPU 1": "stub"},
                                     {"gateway_workers": "1"})
    run = pr.build_run(raw, machine, "quick", "2026-12-01T07:00:00Z", 2, 300, 1000)
    js, md = pr.write_results(run, tmp_path)
    assert js.name == f"peers-2026-12-01-{machine['hostname']}.json" and md.suffix == ".md"

    s = run["summary"]
    assert s["admin"]["added_p50_ms"] == pytest.approx(1.5)
    assert s["litellm"]["stream_added_ttft_ms"] == pytest.approx(7.0)
    text = md.read_text()
    assert "| LiteLLM (one process) | 14.00 ms | 28.00 ms | 14.00 ms / 7.00 ms | 100 | 100 |" in text
    assert "| ours, admin key | 1.50 ms | 3.00 ms | 1.50 ms / 0.75 ms | 800 | 800 |" in text
    assert "| ours, admin key ÷ LiteLLM | 0.11× | 0.11× | 0.11× | 8.00× | 8.00× |" in text
    assert "non-stream c=1: added p50 <= 1.2 ms, admin key: 1.50 ms — **NOT met**" in text
    assert "stream c=32: >= 8x LiteLLM's req/s, admin key: 8.0x (800 vs 100 req/s) — **met**" in text
    for fact in (machine["cpu_model"], f"{machine['cpus']} cores", machine["kernel"], "LiteLLM 1.110.2",
                 f"httpx {machine['versions']['httpx']}", "CPU 0: gateway, engine-proxy", "gateway_workers: 1"):
        assert fact in text, fact
    stored = json.loads(js.read_text())
    assert stored["machine"]["memory_gib"] > 0 and stored["summary"]["plain"]["rps_c32"] == 500.0
    assert not pr.unmeasured(run)

    # without LiteLLM its targets are reported as not measured (bench_peers then exits 1)
    for rounds in raw.values():
        for r in rounds:
            del r["litellm"]
    partial = pr.build_run(raw, machine, "quick", "2026-12-01T07:00:00Z", 2, 300, 1000)
    assert len(pr.unmeasured(partial)) == 4 and all("LiteLLM" in t for t in pr.unmeasured(partial))
    assert "| LiteLLM (one process) | n/a | n/a | n/a / n/a | n/a | n/a |" in pr.markdown(partial)
    json.loads(pr.write_results(partial, tmp_path / "partial")[0].read_text(), parse_constant=pytest.fail)
