"""Health probes of a model server, and the live metrics it exports."""

from __future__ import annotations

import httpx

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import ADDRESSLESS_ENGINES


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
