"""Engines by endpoint, and the endpoints the use-case pack defines without a registration.

A registered endpoint always gets its real engine: if its server is down the caller gets
AllBackendsFailed, never a stand-in. The echo degrade happens only where the spec asks for it:
a pack model with no server configured (no engine.base_url, no EXAMLOPS_VLLM_BASE_URL), and an
in-process engine on a host without the vLLM environment. Each degrade warns, naming the fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass

from examlops.engine import (
    EngineBlockError,
    ModelNotFoundError,
    VllmVenvMissingError,
    find_model,
    parse_engine_block,
    require_vllm_python,
)
from examlops.registry.v1 import registry_pb2 as reg

from ._engines import EchoEngine, Engine, InprocEngine, SglangEngine, VllmServerEngine
from ._settings import EngineProxySettings

log = logging.getLogger(__name__)
PACK_TTL_S = 5.0
RETIRE_AFTER_S = 120.0


@dataclass(slots=True)
class Entry:
    key: tuple[str, str, str, str]
    engine: Engine
    warning: str = ""


def _degrade(warning: str) -> str:
    warnings.warn(warning, RuntimeWarning, stacklevel=3)
    log.warning("%s", warning)
    return warning


class EnginePool:
    def __init__(self, settings: EngineProxySettings) -> None:
        self.settings = settings
        self._entries: dict[str, Entry] = {}
        self._pack: dict[str, tuple[float, reg.Endpoint | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def entry_for(self, ep: reg.Endpoint) -> Entry:
        key = (ep.engine, ep.base_url, ep.served_model_name, ep.engine_block_json)
        current = self._entries.get(ep.name)
        if current is not None and current.key == key:
            return current
        entry = self._build(ep, key)
        if current is not None:
            self._retire(current.engine)
        self._entries[ep.name] = entry
        return entry

    def _build(self, ep: reg.Endpoint, key: tuple[str, str, str, str]) -> Entry:
        served = ep.served_model_name or ep.name
        if ep.engine == "echo":
            return Entry(key, EchoEngine(served), ep.state_reason if ep.state_reason.startswith("degraded") else "")
        if ep.engine == "vllm-inproc":
            try:
                require_vllm_python()
                block = parse_engine_block(json.loads(ep.engine_block_json or "{}"))
            except (VllmVenvMissingError, EngineBlockError) as exc:
                return Entry(key, EchoEngine(served), _degrade(
                    f"endpoint {ep.name!r}: vllm-inproc cannot run here ({exc}); answering with the echo engine"))
            return Entry(key, InprocEngine(ep.name, block, served))
        s = self.settings
        cls = SglangEngine if ep.engine == "sglang" else VllmServerEngine
        engine = cls(ep.name, ep.base_url, api_key=_api_key(ep), connect_timeout_s=s.connect_timeout_s,
                     read_timeout_s=s.read_timeout_s, max_connections=s.max_connections_per_endpoint)
        return Entry(key, engine)

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
            self._retire(entry.engine)

    def _retire(self, engine: Engine) -> None:
        """Close a replaced engine once requests already using it have had time to finish."""
        async def later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            await engine.aclose()

        task = asyncio.get_running_loop().create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for entry in self._entries.values():
            await entry.engine.aclose()


def _api_key(ep: reg.Endpoint) -> str:
    """The server's API key, from the environment variable the block's api_key_secret_ref names."""
    if not ep.engine_block_json:
        return ""
    ref = json.loads(ep.engine_block_json).get("api_key_secret_ref")
    if not ref:
        return ""
    value = os.environ.get(str(ref).removeprefix("env:"), "")
    if not value:
        log.warning("endpoint %r: secret %r is not set in engine-proxy's environment; calling without a key",
                    ep.name, ref)
    return value
