"""A replica as engine-proxy's routing policies read it (the fields of `_routing.Candidate`), for
the policy tests and bench_routing, which call `Router.pick` without a running pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CandidateState:
    id: str
    in_flight: int = 0          # requests the proxy has on it now
    running: float = 0.0        # scraped vllm:num_requests_running
    waiting: float = 0.0        # scraped vllm:num_requests_waiting
    kv_cache_usage: float = 0.0
    metrics_at: float = 0.0     # time.monotonic() of the last good scrape; 0.0 never
