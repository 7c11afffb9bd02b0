"""vLLM's own view of a bench run: its /metrics read just before and just after the measured requests.

Deltas of vLLM's histograms and counters over exactly that window, summed over the servers read:
- `ttft_ms`, `itl_ms`, `e2e_ms`: the means of vllm:time_to_first_token_seconds,
  vllm:inter_token_latency_seconds and vllm:e2e_request_latency_seconds. vLLM starts these clocks when
  its renderer takes the request (before the chat template and tokenization) and stops them when its
  API process receives the engine's output, so they leave out its HTTP handling on both sides: the
  request's parse and validation before, the SSE write after.
- `http_ms`: the mean of http_request_duration_seconds{handler="/v1/chat/completions"}, the histogram
  vLLM's API server keeps (prometheus-fastapi-instrumentator) from its HTTP middleware taking the
  request to the end of the response body.
- `http_extra_ms` = http_ms - e2e_ms: the HTTP handling vLLM's engine clocks leave out, per request.
- `ttft_at_http_ms` = ttft_ms + http_extra_ms: vLLM's TTFT as its HTTP edge serves it, the number a
  client next to the server should see (all of the bench's TTFT but the network and the client).
- `requests`, `output_tokens`: vLLM's TTFT count and vllm:generation_tokens_total. Both equal the
  bench's own counts unless something else used the server during the run (`other_traffic`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: vLLM's series read, by the name a snapshot keeps (histograms by their _sum and _count).
_SERIES = {
    "vllm:time_to_first_token_seconds_sum": "ttft_sum", "vllm:time_to_first_token_seconds_count": "ttft_n",
    "vllm:inter_token_latency_seconds_sum": "itl_sum", "vllm:inter_token_latency_seconds_count": "itl_n",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum", "vllm:e2e_request_latency_seconds_count": "e2e_n",
    "vllm:generation_tokens_total": "tokens",
}
_HTTP = "http_request_duration_seconds"
_CHAT = "/v1/chat/completions"


def parse_snapshot(text: str) -> dict[str, float]:
    """The series a bench compares, summed over their label sets (a server may label by model)."""
    out = dict.fromkeys([*_SERIES.values(), "http_sum", "http_n"], 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SERIES:
                out[_SERIES[sample.name]] += sample.value
            elif sample.name in (f"{_HTTP}_sum", f"{_HTTP}_count") and sample.labels.get("handler") == _CHAT:
                out["http_sum" if sample.name.endswith("_sum") else "http_n"] += sample.value
    return out


async def _one(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | str:
    url = f"{base_url.rstrip('/')}/metrics"
    try:
        resp = await client.get(url, timeout=10.0)
    except httpx.HTTPError as exc:
        return f"{url} unreachable: {type(exc).__name__}"
    if resp.status_code != 200:
        return f"{url} answered {resp.status_code}"
    try:
        return parse_snapshot(resp.text)
    except ValueError as exc:
        return f"{url} is not Prometheus text: {exc}"


async def snapshot(client: httpx.AsyncClient, servers: list[str]) -> list[dict[str, float]] | str:
    """Every server's series, or why one of them could not be read."""
    got = await asyncio.gather(*(_one(client, url) for url in servers))
    for item in got:
        if isinstance(item, str):
            return item
    return [item for item in got if not isinstance(item, str)]


def _http_behind(base: list[dict[str, float]], now: list[dict[str, float]]) -> bool:
    return any(n["http_n"] - b["http_n"] < n["e2e_n"] - b["e2e_n"] for b, n in zip(base, now, strict=True))


async def settled(client: httpx.AsyncClient, servers: list[str], base: list[dict[str, float]] | str,
                  wait_s: float = 2.0) -> list[dict[str, float]] | str:
    """A snapshot once every request finished since `base` is in the HTTP histogram too.

    vLLM observes a request's HTTP duration after the last byte of its answer is written, so a client
    can see the end of its stream a moment before the server counts it (the engine clocks were
    stopped before): reading too soon would leave the last requests out of `http_ms`.
    """
    now = await snapshot(client, servers)
    deadline = asyncio.get_running_loop().time() + wait_s
    while (not isinstance(base, str) and not isinstance(now, str) and _http_behind(base, now)
           and asyncio.get_running_loop().time() < deadline):
        await asyncio.sleep(0.02)
        now = await snapshot(client, servers)
    return now


def _mean_ms(delta: dict[str, float], name: str) -> float | None:
    n = delta[f"{name}_n"]
    return delta[f"{name}_sum"] / n * 1e3 if n > 0 else None


def server_view(servers: list[str], before: list[dict[str, float]] | str, after: list[dict[str, float]] | str,
                completed: int, output_tokens: int) -> dict[str, Any]:
    """The window's deltas and means (module docstring); `error` says why there are none."""
    if isinstance(before, str) or isinstance(after, str):
        return {"servers": servers, "error": before if isinstance(before, str) else after}
    delta = {key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) for key in after[0]}
    ttft, e2e, http = _mean_ms(delta, "ttft"), _mean_ms(delta, "e2e"), _mean_ms(delta, "http")
    # The HTTP histogram counts requests as the instrumentator sees them end; it only describes the
    # same requests as e2e when both counted the same number.
    extra = http - e2e if http is not None and e2e is not None and delta["http_n"] == delta["e2e_n"] else None
    view: dict[str, Any] = {
        "servers": servers, "requests": int(delta["ttft_n"]), "output_tokens": int(delta["tokens"]),
        "ttft_ms": ttft, "itl_ms": _mean_ms(delta, "itl"), "e2e_ms": e2e, "http_ms": http,
        "http_extra_ms": extra,
        "ttft_at_http_ms": ttft + extra if ttft is not None and extra is not None else None,
    }
    view["other_traffic"] = view["requests"] != completed or view["output_tokens"] != output_tokens
    return view
