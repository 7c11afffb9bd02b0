"""`exa serve llm bench` on a real CPU vLLM (SmolLM2), checked against vLLM's own metrics.

What "agrees with vLLM" compares, over the same window (vLLM's /metrics read just before and just
after one bench run, nothing else generating on that server meanwhile):
- output tokens: the bench's total (each stream's usage) equals the delta of
  vllm:generation_tokens_total exactly, and TTFT was observed for exactly the bench's requests;
- the bench's own report of vLLM's view (its `server` section, read by the CLI around the measured
  requests) equals what this test reads around the whole command;
- mean TTFT, within 10%: vLLM's TTFT histogram (vllm:time_to_first_token_seconds) starts its clock
  when its renderer takes the request and stops it when its API process receives the first token,
  so it leaves out the server's HTTP handling (parse and validation before, the SSE write after).
  vLLM's API server keeps that part in its own histogram too: http_request_duration_seconds runs
  from its HTTP middleware to the end of the answer, vllm:e2e_request_latency_seconds from the same
  start as TTFT to the last token, and the difference of their means is the HTTP handling per
  request. The bench's mean TTFT is compared with vLLM's TTFT plus that difference (vLLM's TTFT at
  its HTTP edge); what is left is the network and the client (and, through the gateway, the gateway
  and engine-proxy);
- output tokens/s: the bench's (its tokens over its wall time) against vLLM's generation_tokens
  delta over vLLM's busy window, within 10%. That window is seen by sampling the token counter every
  0.25 s from this process (an independent clock): from the first wave's arrival, which is the first
  token minus that wave's TTFT as vLLM measured it (nothing counts while the first prompts prefill),
  to the last move of the token counter. Each edge is known to lie between two sampling moments (a
  scrape slowed by a busy machine widens that span, never shifts it), so the check is that some
  window the samples allow gives a rate within 10% of the bench's. (Over the bench's own wall time
  the two rates are equal by the exact token count above.)
One vLLM on the machine at a time: run these under `flock /tmp/exa-vllm.lock`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.vllm import smol_block, start_vllm

REQUESTS, MAX_TOKENS = 24, 48
RUN = ("--requests", str(REQUESTS), "--concurrency", "4", "--prompt-tokens", "256", "--max-tokens", str(MAX_TOKENS),
       "--warmup", "0")


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc: Proc = start_vllm(tmp_path_factory.mktemp("vllm"), port, smol_block())
    url = f"http://127.0.0.1:{port}"
    try:
        httpx.post(url + "/v1/chat/completions", timeout=120, json={  # first-request costs out of every window
            "model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def smol(stack: Stack, vllm_url: str) -> str:
    """The real server registered as endpoint `smol` and routed by the gateway."""
    out = stack.cli("serve", "llm", "start", "smol", "--base-url", vllm_url, "--replace")
    assert out.returncode == 0, out.stderr
    headers = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
    wait_until(lambda: any(m["id"] == "smol" for m in httpx.get(
        stack.gateway_url + "/v1/models", headers=headers).json()["data"]), 10, 0.1, "smol routed")
    for stream in (False, True):  # the route's first-call costs (connections, lazy imports) out of every window
        httpx.post(stack.gateway_url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "smol", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()
    return vllm_url


def vllm_counters(url: str) -> dict[str, float]:
    wanted = {"vllm:time_to_first_token_seconds_sum": "ttft_sum", "vllm:time_to_first_token_seconds_count": "ttft_n",
              "vllm:generation_tokens_total": "tokens", "vllm:inter_token_latency_seconds_sum": "itl_sum",
              "vllm:inter_token_latency_seconds_count": "itl_n", "vllm:prefix_cache_hits_total": "hits",
              "vllm:prefix_cache_queries_total": "queries", "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
              "vllm:e2e_request_latency_seconds_count": "e2e_n",
              # vLLM's API server's own HTTP histogram, of its chat handler only
              "http_request_duration_seconds_sum": "http_sum", "http_request_duration_seconds_count": "http_n"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in wanted and (not sample.name.startswith("http_")
                                          or sample.labels.get("handler") == "/v1/chat/completions"):
                out[wanted[sample.name]] += sample.value
    return out


_COUNTERS = re.compile(rb"^vllm:(generation_tokens_total|time_to_first_token_seconds_(?:sum|count))\{[^}]*\} (\S+)$",
                       re.M)


def token_counters(url: str) -> dict[str, float]:
    """The three series the window needs, found by a regex (a full parse costs this 2-core machine
    more than the server's work it watches)."""
    out = {"tokens": 0.0, "ttft_sum": 0.0, "ttft_n": 0.0}
    names = {b"generation_tokens_total": "tokens", b"time_to_first_token_seconds_sum": "ttft_sum",
             b"time_to_first_token_seconds_count": "ttft_n"}
    for name, value in _COUNTERS.findall(httpx.get(url + "/metrics", timeout=10).content):
        out[names[name]] += float(value)
    return out


class TokenWindow(threading.Thread):
    """Samples vLLM's counters every 0.25 s: when the first wave arrived and the token counter stopped.
    A sample is taken somewhere between the moment its GET was sent and the moment its answer was in,
    so each edge of the window is known only to lie between two such moments: `bounds` gives the
    shortest and the longest window the samples allow (a slow scrape widens them, never shifts them)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.done = url, list[tuple[float, float, dict[str, float]]](), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sent = time.monotonic()
            counters = token_counters(self.url)
            self.samples.append((sent, time.monotonic(), counters))
            self.done.wait(0.25)

    def bounds(self) -> tuple[float, float]:
        """(shortest, longest) window: from the first wave's arrival (its first token less its mean TTFT
        by vLLM's histogram; nothing counts while the first prompts prefill) to the token counter's last
        move. The first token lies after the last still sample was sent and before the first moved
        sample's answer was in; the last move likewise around the first sample with the final count."""
        self.done.set()
        self.join()
        tokens = [c["tokens"] for _, _, c in self.samples]
        i = next(k for k, v in enumerate(tokens) if v > tokens[0])
        j = next(k for k, v in enumerate(tokens) if v == tokens[-1])
        base, moved = self.samples[0][2], self.samples[i][2]
        first_wave_ttft = (moved["ttft_sum"] - base["ttft_sum"]) / max(moved["ttft_n"] - base["ttft_n"], 1)
        first = (self.samples[i - 1][0], self.samples[i][1])
        last = (self.samples[j - 1][0], self.samples[j][1])
        return last[0] - first[1] + first_wave_ttft, last[1] - first[0] + first_wave_ttft


def bench_against_vllm(stack: Stack, url: str, *args: str) -> tuple[dict[str, Any], dict[str, float], str]:
    """(the bench's --json report, vLLM's own numbers for the same window, the bench's stderr)."""
    before = vllm_counters(url)
    window = TokenWindow(url)
    window.start()
    out = stack.cli("--json", "serve", "llm", "bench", "smol", *RUN, *args, timeout=600)
    shortest, longest = window.bounds()
    after = vllm_counters(url)
    assert out.returncode == 0, out.stderr
    delta = {k: after[k] - before[k] for k in after}
    vllm = {"requests": delta["ttft_n"], "tokens": delta["tokens"], "http_n": delta["http_n"],
            "ttft_mean_ms": delta["ttft_sum"] / delta["ttft_n"] * 1e3,
            "itl_mean_ms": delta["itl_sum"] / delta["itl_n"] * 1e3,
            "e2e_mean_ms": delta["e2e_sum"] / delta["e2e_n"] * 1e3,
            "http_mean_ms": delta["http_sum"] / delta["http_n"] * 1e3,
            "window_s": (shortest + longest) / 2, "window_shortest_s": shortest, "window_longest_s": longest}
    vllm["tokens_per_s"] = delta["tokens"] / vllm["window_s"]
    vllm["ttft_at_http_ms"] = vllm["ttft_mean_ms"] + vllm["http_mean_ms"] - vllm["e2e_mean_ms"]
    return json.loads(out.stdout), vllm, out.stderr


def compare(label: str, report: dict[str, Any], vllm: dict[str, float]) -> None:
    bench_ttft, spread = report["ttft_ms"]["mean"], vllm["window_s"] - vllm["window_shortest_s"]
    print(f"\n{label}: bench TTFT mean {bench_ttft:.1f} ms vs vLLM {vllm['ttft_mean_ms']:.1f} ms by its engine clock, "
          f"{vllm['ttft_at_http_ms']:.1f} ms at its HTTP edge ({bench_ttft / vllm['ttft_at_http_ms'] - 1:+.1%}); "
          f"ITL mean {report['itl_ms']['mean']:.1f} vs {vllm['itl_mean_ms']:.1f} ms; "
          f"{report['output_tokens_per_s']:.1f} vs {vllm['tokens_per_s']:.1f} output tokens/s "
          f"({report['duration_s']:.2f} s vs {vllm['window_s']:.2f} s ± {spread:.2f}); "
          f"{report['output_tokens']} vs {vllm['tokens']:.0f} tokens")
    assert report["completed"] == REQUESTS and report["failed"] == 0 and vllm["requests"] == REQUESTS
    assert vllm["http_n"] == REQUESTS  # every request's HTTP duration was in before this test read it
    assert report["output_tokens"] == vllm["tokens"] == REQUESTS * MAX_TOKENS  # ignore_eos: exactly --max-tokens each
    server = report["server"]  # the CLI's own reading of vLLM over its measured requests (--warmup 0: the same)
    assert server["requests"] == REQUESTS and server["output_tokens"] == REQUESTS * MAX_TOKENS
    assert not server["other_traffic"]
    for key, ours in (("ttft_ms", "ttft_mean_ms"), ("e2e_ms", "e2e_mean_ms"), ("http_ms", "http_mean_ms"),
                      ("ttft_at_http_ms", "ttft_at_http_ms")):
        assert server[key] == pytest.approx(vllm[ours], rel=1e-6), key
    assert bench_ttft >= vllm["ttft_mean_ms"] - 1.0  # vLLM's interval lies inside the bench's (1 ms: clock rounding)
    assert bench_ttft == pytest.approx(vllm["ttft_at_http_ms"], rel=0.10)
    # tokens/s within 10%: the same tokens, so the bench's wall time within 10% of a window the samples allow
    wall = report["duration_s"]
    assert vllm["window_shortest_s"] <= 1.1 * wall and vllm["window_longest_s"] >= 0.9 * wall, vllm


@pytest.mark.vllm
def test_direct_bench_agrees_with_vllms_own_metrics(stack: Stack, smol: str) -> None:
    report, vllm, stderr = bench_against_vllm(stack, smol, "--direct")
    compare("--direct", report, vllm)
    assert report["via"] == "direct" and report["targets"] == [smol + "/v1/chat/completions"]
    assert "bench smol via direct" in stderr and f"{REQUESTS}/{REQUESTS}" in stderr  # the progress bar, on stderr


@pytest.mark.vllm
def test_gateway_bench_agrees_with_vllms_own_metrics(stack: Stack, smol: str) -> None:
    report, vllm, stderr = bench_against_vllm(stack, smol)
    compare("through the gateway", report, vllm)
    assert report["via"] == "gateway" and report["targets"] == [stack.gateway_url + "/v1/chat/completions"]
    assert set(report) == {
        "model", "via", "targets", "settings", "completed", "failed", "errors", "duration_s", "requests_per_s",
        "output_tokens", "output_tokens_per_s", "output_tokens_exact", "prompt_tokens", "prompt_tokens_mean",
        "ttft_ms", "itl_ms", "tpot_ms", "latency_ms", "server"}
    assert report["settings"] == {"concurrency": 4, "requests": REQUESTS, "warmup": 0, "prompt_tokens": 256,
                                  "max_tokens": MAX_TOKENS, "ignore_eos": True}
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        dist = report[key]
        assert set(dist) == {"mean", "p50", "p90", "p99", "min", "max"}
        assert 0 < dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert report["output_tokens_exact"] and report["requests_per_s"] > 0
    assert 256 <= report["prompt_tokens_mean"] <= 256 + 60  # the prompt, plus SmolLM2's chat template
    assert "bench smol via gateway" in stderr


@pytest.mark.vllm
def test_report_for_people_and_warmup(stack: Stack, smol: str) -> None:
    before = vllm_counters(smol)
    out = stack.cli("serve", "llm", "bench", "smol", "--requests", "3", "--concurrency", "2", "--warmup", "2",
                    "--max-tokens", "5", "--prompt-tokens", "40", timeout=300)
    assert out.returncode == 0, out.stderr
    print("\n" + out.stdout + out.stderr)
    assert vllm_counters(smol)["ttft_n"] - before["ttft_n"] == 5  # 2 warm-up + 3 measured
    text = " ".join(out.stdout.split())  # as printed, less the terminal's line wrapping
    assert "TTFT" in text and "inter-token latency" in text
    assert "15 output tokens, 3 completed, 0 failed" in text
    assert "warm-up" in out.stderr and "3/3" in out.stderr and "TTFT" not in out.stderr
    # vLLM's view frames the measured requests only: the warm-up is read out of it
    assert "vLLM's own metrics over the same requests (1 server): TTFT mean" in text
    assert "at its HTTP edge" in text and "the network and the client, the gateway and engine-proxy" in text
    assert "15 output tokens, 3 requests" in text
    out = stack.cli("--json", "serve", "llm", "bench", "smol", "--requests", "1", "--max-tokens", "2",
                    "--warmup", "0", "--no-server-metrics", timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["server"] == {"servers": [], "error": "not read (--no-server-metrics)"}


@pytest.mark.vllm
def test_status_shows_the_prefix_cache_hit_rate(stack: Stack, smol: str) -> None:
    prompt = "Repeat after me: " + " ".join(["the cat sat on the mat"] * 40)
    for _ in range(2):  # the second finds the first's prompt blocks cached
        httpx.post(smol + "/v1/chat/completions", timeout=60, json={
            "model": "smol", "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}).raise_for_status()
    raw = vllm_counters(smol)
    out = stack.cli("--json", "serve", "llm", "status", "smol")
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout)["replicas"][0]["metrics"]
    assert raw["hits"] > 0
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(raw["hits"] / raw["queries"])
    assert "spec_decode_acceptance_rate" not in metrics  # this server has no speculative decoding
    table = stack.cli("serve", "llm", "status", "smol").stdout
    assert "prefix hits" in table and f"{raw['hits'] / raw['queries']:.1%}" in table


def test_errors_name_the_fix(stack: Stack) -> None:
    out = stack.cli("serve", "llm", "bench", "no-such-model")
    assert out.returncode == 1 and "unknown model 'no-such-model'" in out.stderr and "exa serve llm list" in out.stderr
    out = stack.cli("serve", "llm", "bench", "no-such-model", "--direct")
    assert out.returncode == 1 and "unknown model 'no-such-model'" in out.stderr
    out = stack.cli("serve", "llm", "bench", "smol", "--key", "sk-not-a-key")
    assert out.returncode == 1 and "refused --key" in out.stderr and "exa gateway key issue" in out.stderr
    out = stack.cli("serve", "llm", "bench", "smol", env={"EXAMLOPS_GATEWAY_URL": f"http://127.0.0.1:{free_port()}"})
    assert out.returncode == 1 and "cannot reach the gateway" in out.stderr and "--direct" in out.stderr
    out = stack.cli("--json", "serve", "llm", "bench", "smol", "--direct",
                    env={"EXAMLOPS_REGISTRY_ADDR": f"127.0.0.1:{free_port()}"})
    assert out.returncode == 1 and "cannot reach registry" in json.loads(out.stderr)["error"]


def test_direct_needs_a_ready_server(stack: Stack) -> None:
    stack.register("bench-echo", engine="echo")
    out = stack.cli("serve", "llm", "bench", "bench-echo", "--direct")
    assert out.returncode == 1 and "runs inside engine-proxy" in out.stderr and "through the gateway" in out.stderr
    stack.register("bench-down", engine="vllm", base_url="http://127.0.0.1:9", served_model_name="x",
                   state=reg.ENDPOINT_STATE_FAILED)
    out = stack.cli("serve", "llm", "bench", "bench-down", "--direct")
    assert out.returncode == 1 and "no READY replica" in out.stderr and "exa serve llm status bench-down" in out.stderr


@pytest.fixture
def bench_echo(stack: Stack) -> str:
    """An echo endpoint (no server of its own), routed by the gateway."""
    stack.register("bench-echo", engine="echo")
    headers = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
    wait_until(lambda: any(m["id"] == "bench-echo" for m in httpx.get(
        stack.gateway_url + "/v1/models", headers=headers).json()["data"]), 10, 0.1, "bench-echo routed")
    return "bench-echo"


def test_an_engine_without_a_server_has_no_server_view(stack: Stack, bench_echo: str) -> None:
    out = stack.cli("--json", "serve", "llm", "bench", "bench-echo", "--requests", "2", "--warmup", "0",
                    "--max-tokens", "4", "--prompt-tokens", "8")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["completed"] == 2 and report["server"]["servers"] == []
    assert "bench-echo runs inside engine-proxy (engine echo)" in report["server"]["error"]
    out = stack.cli("serve", "llm", "bench", "bench-echo", "--requests", "1", "--warmup", "0", "--max-tokens", "2")
    assert out.returncode == 0 and "vLLM's own metrics: bench-echo runs inside engine-proxy" in out.stderr


def test_a_failing_first_request_stops_the_run(stack: Stack, bench_echo: str) -> None:
    """A key the gateway refuses for every call (a budget on an unpriced model): one error, nothing measured."""
    headers = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
    issued = httpx.post(stack.gateway_url + "/admin/keys", headers=headers, timeout=10, json={
        "tenant": "t", "project": "p", "models": ["bench-echo"], "budget_usd": 1})
    assert issued.status_code == 201, issued.text
    out = stack.cli("serve", "llm", "bench", "bench-echo", "--requests", "50", "--warmup", "0",
                    "--key", issued.json()["virtual_key"])
    assert out.returncode == 1 and "the first request failed, 403" in out.stderr and "has no price" in out.stderr
    assert "nothing measured" in out.stderr and "50/50" not in out.stderr
