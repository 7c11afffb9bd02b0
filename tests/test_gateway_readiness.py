"""Liveness and readiness of a gateway whose Redis goes away under it and comes back.

The stack has a Redis of its own (stopping it must not touch the session's); /livez stays 200 while
the process serves, /readyz says 503 naming redis while it is down, and ready again once it is back.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from examlops_testsupport.fixtures import running_stack, start_redis, wait_until


def _probe(url: str) -> tuple[int, dict[str, object]]:
    resp = httpx.get(url, timeout=5)
    return resp.status_code, resp.json()


def test_readyz_follows_redis_and_livez_does_not(tmp_path: Path) -> None:
    own = start_redis(tmp_path / "redis")
    try:
        with running_stack(tmp_path / "stack", own) as stack:
            base = stack.gateway_url
            assert _probe(base + "/livez")[0] == 200
            status, body = _probe(base + "/readyz")
            assert (status, body["failing"]) == (200, []), body
            assert _probe(base + "/healthz")[0] == 200  # /healthz is readiness, kept for old probes

            own.proc.stop(signal.SIGKILL)
            wait_until(lambda: _probe(base + "/readyz")[0] == 503, 5, 0.1)
            status, body = _probe(base + "/readyz")
            assert body["failing"] == ["redis"] and body["status"] == "unavailable", body
            assert _probe(base + "/healthz")[0] == 503  # /healthz is readiness
            assert _probe(base + "/livez")[0] == 200

            own = start_redis(tmp_path / "redis", own.port)
            wait_until(lambda: _probe(base + "/readyz")[0] == 200, 10, 0.1)
            assert _probe(base + "/readyz")[1]["failing"] == []
    finally:
        own.proc.stop()
