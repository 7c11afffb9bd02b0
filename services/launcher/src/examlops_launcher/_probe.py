"""Health probes of a model server, and the live metrics it exports."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import ADDRESSLESS_ENGINES

#: vLLM's gauges and counters an operator looks at first, summed over their label sets.
_SUMMED = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",          # older vLLM releases
    "vllm:prompt_tokens": "prompt_tokens_total",
    "vllm:generation_tokens": "generation_tokens_total",
    "vllm:request_success": "requests_finished_total",
    # Counted in tokens over the server's life: hit rate = hits / queries (prompt tokens found cached).
    "vllm:prefix_cache_queries": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits": "prefix_cache_hits_total",
    # Speculative decoding: acceptance rate = accepted / proposed draft tokens, over the server's life.
    "vllm:spec_decode_num_draft_tokens": "spec_decode_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens": "spec_decode_accepted_tokens_total",
}
#: Ratios of two summed counters (numerator, denominator), recomputed for a pool from its sums.
_RATIOS = {
    "prefix_cache_hit_rate": ("prefix_cache_hits_total", "prefix_cache_queries_total"),
    "spec_decode_acceptance_rate": ("spec_decode_accepted_tokens_total", "spec_decode_draft_tokens_total"),
}
_TTFT = "vllm:time_to_first_token_seconds"


async def probe(client: httpx.AsyncClient, ep: reg.Endpoint, timeout_s: float) -> tuple[bool, str]:
    """(healthy, what was seen). Engines without a server are healthy by construction."""
    if ep.engine in ADDRESSLESS_ENGINES:
        return True, f"engine {ep.engine} runs inside engine-proxy"
    if not ep.base_url:
        return False, "no address yet"
    url = f"{ep.base_url}/health"
    try:
        resp = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return False, f"{url} unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
    if resp.status_code == 200:
        return True, f"{url} answered 200"
    return False, f"{url} answered {resp.status_code}"


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The headline numbers of a vLLM /metrics page.

    TTFT is a mean, prefix_cache_hit_rate and spec_decode_acceptance_rate are ratios of counters: all
    over the server's life (since it started), not over a recent window. A ratio is absent while its
    denominator is 0 (no prompt yet; no speculative decoding configured).
    """
    out: dict[str, float] = {}
    ttft_sum = ttft_count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{_TTFT}_sum":
                ttft_sum += sample.value
            elif sample.name == f"{_TTFT}_count":
                ttft_count += sample.value
            else:
                name = sample.name.removesuffix("_total")
                if name in _SUMMED and not sample.name.endswith("_created"):
                    key = _SUMMED[name]
                    out[key] = out.get(key, 0.0) + sample.value
    if ttft_count:
        out["ttft_mean_s"] = ttft_sum / ttft_count
        out["ttft_requests"] = ttft_count
    return _with_ratios(out)


def _with_ratios(metrics: dict[str, float]) -> dict[str, float]:
    for ratio, (numerator, denominator) in _RATIOS.items():
        if metrics.get(denominator):
            metrics[ratio] = metrics.get(numerator, 0.0) / metrics[denominator]
    return metrics


async def read_metrics(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> tuple[dict[str, float], str]:
    """(metrics, error): the server's live metrics, or why there are none."""
    if not base_url:
        return {}, "no address yet"
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {}, f"{base_url}/metrics unreachable: {type(exc).__name__}"
    if resp.status_code != 200:
        return {}, f"{base_url}/metrics answered {resp.status_code}"
    try:
        return parse_vllm_metrics(resp.text), ""
    except ValueError as exc:
        return {}, f"{base_url}/metrics is not Prometheus text: {exc}"


#: Per-server fractions: a pool shows their mean, not their sum.
_MEANS = ("kv_cache_usage",)


def pool_metrics(per_replica: list[dict[str, float]]) -> dict[str, float]:
    """A pool's metrics from its replicas': counts summed, KV-cache usage averaged, TTFT weighted by
    requests, ratios recomputed from the summed counters (so a busy replica weighs more)."""
    reporting = [m for m in per_replica if m]
    out: dict[str, float] = {}
    for m in reporting:
        for key, value in m.items():
            if key != "ttft_mean_s" and key not in _RATIOS:
                out[key] = out.get(key, 0.0) + value
    for key in _MEANS:
        having = [m[key] for m in reporting if key in m]
        if having:
            out[key] = sum(having) / len(having)
    timed = [(m["ttft_mean_s"], m.get("ttft_requests", 0.0)) for m in reporting if "ttft_mean_s" in m]
    if timed and sum(n for _, n in timed):
        out["ttft_mean_s"] = sum(t * n for t, n in timed) / sum(n for _, n in timed)
    return _with_ratios(out)
