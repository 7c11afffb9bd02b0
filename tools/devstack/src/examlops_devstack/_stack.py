"""The five services and how each is configured, in one place (make up, tests, compose docs)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from examlops.svc import DEFAULT_PORTS

#: name -> python module; started in this order (dependencies first).
SERVICES: dict[str, str] = {
    "registry": "examlops_registry",
    "mediaguard": "examlops_mediaguard",
    "engine-proxy": "examlops_engine_proxy",
    "launcher": "examlops_launcher",
    "gateway": "examlops_gateway",
}


@dataclass
class StackPorts:
    redis: int = 6379
    services: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    vllm: int = 8000

    @classmethod
    def with_offset(cls, offset: int) -> StackPorts:
        """The default ports shifted by `offset`, for a second stack beside the first."""
        return cls(redis=6379 + offset, services={k: v + offset for k, v in DEFAULT_PORTS.items()},
                   vllm=8000 + offset)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.services[name]}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.services['gateway']}"


def service_env(name: str, ports: StackPorts, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for one service (and for the CLI when name is 'cli')."""
    env = {
        "EXAMLOPS_REDIS_URL": ports.redis_url,
        "EXAMLOPS_REGISTRY_ADDR": ports.addr("registry"),
        "EXAMLOPS_LAUNCHER_ADDR": ports.addr("launcher"),
        "EXAMLOPS_MEDIAGUARD_ADDR": ports.addr("mediaguard"),
        "EXAMLOPS_ENGINE_PROXY_ADDR": ports.addr("engine-proxy"),
        "EXAMLOPS_GATEWAY_URL": ports.gateway_url,
        "PYTHONUNBUFFERED": "1",
    }
    if name in ports.services:
        env["EXAMLOPS_PORT"] = str(ports.services[name])
    return {**env, **(extra or {})}


def service_argv(name: str) -> list[str]:
    return [sys.executable, "-m", SERVICES[name]]
