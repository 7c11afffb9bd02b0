"""Engines by endpoint (a pool of replicas, _replica_set), and the endpoints the use-case pack
defines without a registration.

A registered endpoint always gets its real engine: if its server is down the caller gets
AllBackendsFailed, never a stand-in. The echo degrade happens only where the spec asks for it:
a pack model with no server configured (no engine.base_url, no EXAMLOPS_VLLM_BASE_URL), and an
in-process engine on a host without the vLLM environment. Each degrade warns, naming the fix.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

from examlops.engine import (
    EngineBlockError,
    ModelNotFoundError,
    VllmVenvMissingError,
    find_model,
    parse_engine_block,
    require_vllm_python,
    routing_of,
)
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import ADDRESSLESS_ENGINES, routable_replicas

from ._engines import EchoEngine, Engine, InprocEngine, SglangEngine, VllmServerEngine
from ._replica_set import EngineFactory, ReplicaSet
from ._settings import EngineProxySettings

log = logging.getLogger(__name__)
PACK_TTL_S = 5.0


@dataclass(slots=True)
class Entry:
    """An endpoint's engines: a pool of replicas (servers) or one addressless engine."""

    key: tuple[str, str, str]         # what its engines are built from (a change rebuilds them)
    source: reg.Endpoint              # the record last synced (the request path compares identity)
    pool: ReplicaSet
    warning: str = ""


def _degrade(warning: str) -> str:
    warnings.warn(warning, RuntimeWarning, stacklevel=3)
    log.warning("%s", warning)
    return warning


def _engine_key(ep: reg.Endpoint) -> tuple[str, str, str]:
    """An addressless engine is built from the whole record; a server pool's engines only from the
    engine kind and the API key (the block's routing or its replicas change in place)."""
    if ep.engine in ADDRESSLESS_ENGINES:
        return ep.engine, ep.served_model_name, ep.engine_block_json
    return ep.engine, "", str(_block(ep).get("api_key_secret_ref") or "")


class EnginePool:
    def __init__(self, settings: EngineProxySettings) -> None:
        self.settings = settings
        self._entries: dict[str, Entry] = {}
        self._pack: dict[str, tuple[float, reg.Endpoint | None]] = {}

    def entry_for(self, ep: reg.Endpoint) -> Entry:
        current = self._entries.get(ep.name)
        if current is not None and current.source is ep:
            return current
        key = _engine_key(ep)
        if current is not None and current.key == key:
            if ep.engine not in ADDRESSLESS_ENGINES:
                current.pool.sync(routable_replicas(ep), routing_of(ep.engine_block_json), self._factory(ep),
                                  _spec_decode(ep))
            current.source = ep
            return current
        entry = self._build(ep, key)
        if current is not None:
            current.pool.drain_all()
        self._entries[ep.name] = entry
        return entry

    def refresh(self, ep: reg.Endpoint) -> None:
        """A registry change of an endpoint already in use: its pool follows it now (a removed
        replica starts draining even if no request comes)."""
        if ep.name in self._entries:
            self.entry_for(ep)

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def _build(self, ep: reg.Endpoint, key: tuple[str, str, str]) -> Entry:
        served = ep.served_model_name or ep.name
        if ep.engine == "echo":
            warning = ep.state_reason if ep.state_reason.startswith("degraded") else ""
            return Entry(key, ep, ReplicaSet.single(ep.name, EchoEngine(served)), warning)
        if ep.engine == "vllm-inproc":
            try:
                require_vllm_python()
                block = parse_engine_block(json.loads(ep.engine_block_json or "{}"))
            except (VllmVenvMissingError, EngineBlockError) as exc:
                return Entry(key, ep, ReplicaSet.single(ep.name, EchoEngine(served)), _degrade(
                    f"endpoint {ep.name!r}: vllm-inproc cannot run here ({exc}); answering with the echo engine"))
            return Entry(key, ep, ReplicaSet.single(ep.name, InprocEngine(ep.name, block, served)))
        pool = ReplicaSet(ep.name, routing_of(ep.engine_block_json), self.settings.replica_scrape_interval_s)
        pool.sync(routable_replicas(ep), pool.policy, self._factory(ep), _spec_decode(ep))
        return Entry(key, ep, pool)

    def _factory(self, ep: reg.Endpoint) -> EngineFactory:
        """Makes the engine of one replica of `ep` (its own aiohttp session) from its base_url."""
        s = self.settings
        cls = SglangEngine if ep.engine == "sglang" else VllmServerEngine
        api_key = _api_key(ep)

        def make(base_url: str) -> Engine:
            return cls(ep.name, base_url, api_key=api_key, connect_timeout_s=s.connect_timeout_s,
                       read_timeout_s=s.read_timeout_s, max_connections=s.max_connections_per_endpoint)
        return make

    def pack_endpoint(self, name: str) -> reg.Endpoint | None:
        """An endpoint for a model the use-case pack defines but nobody registered (cached briefly)."""
        if not self.settings.usecase_dir:
            return None
        cached = self._pack.get(name)
        if cached is not None and time.monotonic() - cached[0] < PACK_TTL_S:
            return cached[1]
        try:
            block = find_model(name, self.settings.usecase_dir).engine
        except (ModelNotFoundError, EngineBlockError, OSError):
            self._pack[name] = (time.monotonic(), None)
            return None
        ep = reg.Endpoint(name=name, engine=block.engine, served_model_name=block.served_model_name or name,
                          base_url=(block.base_url or self.settings.vllm_base_url).rstrip("/"),
                          engine_block_json=block.model_dump_json(exclude_none=True),
                          state=reg.ENDPOINT_STATE_READY)
        if ep.engine in ("vllm-server", "sglang") and not ep.base_url:
            ep.engine = "echo"
            ep.state_reason = _degrade(
                f"degraded: no server configured for model {name!r}: set engine.base_url in its use-case "
                "pack file or EXAMLOPS_VLLM_BASE_URL; answering with the echo engine")
        self._pack[name] = (time.monotonic(), ep)
        return ep

    def forget(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            entry.pool.drain_all()

    async def aclose(self) -> None:
        for entry in self._entries.values():
            await entry.pool.aclose()


def _block(ep: reg.Endpoint) -> dict[str, Any]:
    data = json.loads(ep.engine_block_json) if ep.engine_block_json else {}
    return data if isinstance(data, dict) else {}


def _spec_decode(ep: reg.Endpoint) -> bool:
    """Whether the endpoint's engine block enables speculative decoding (its calls then carry SpecDecode)."""
    spec = _block(ep).get("speculative_decoding")
    return isinstance(spec, dict) and spec.get("enabled") is True


def _api_key(ep: reg.Endpoint) -> str:
    """The server's API key, from the environment variable the block's api_key_secret_ref names."""
    ref = _block(ep).get("api_key_secret_ref")
    if not ref:
        return ""
    value = os.environ.get(str(ref).removeprefix("env:"), "")
    if not value:
        log.warning("endpoint %r: secret %r is not set in engine-proxy's environment; calling without a key",
                    ep.name, ref)
    return value
