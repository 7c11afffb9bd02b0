"""The five services and how each is configured, in one place (make up, tests, compose docs)."""

from __future__ import annotations

import getpass
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from examlops.svc import (
    DEFAULT_PORTS,
    OPERATOR_PREFIX,
    OPERATOR_TOKEN_VAR,
    SERVICE_TOKEN_VAR,
    TOKENS_FILE_VAR,
    parse_tokens,
)

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
    #: The gateway's own Redis (virtual keys, budgets, cost records: appendfsync everysec); None: `redis`.
    gateway_redis: int | None = None
    services: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    vllm: int = 8000      # SmolLM2 (generation)
    minilm: int = 8001    # all-MiniLM-L6-v2 (embeddings); the sample pack's minilm.yaml says the same
    #: gRPC service -> its Prometheus /metrics port (EXAMLOPS_METRICS_PORT); a service not listed has none.
    metrics: dict[str, int] = field(default_factory=dict)
    #: make up's Prometheus (9090 is left to a system one: Debian's package starts it where systemd runs).
    prometheus: int = 9099

    @classmethod
    def with_offset(cls, offset: int) -> StackPorts:
        """The default ports shifted by `offset`, for a second stack beside the first; each gRPC
        service's metrics port is its own port + 10 (50061-50064)."""
        return cls(redis=6379 + offset, gateway_redis=6380 + offset,
                   services={k: v + offset for k, v in DEFAULT_PORTS.items()},
                   vllm=8000 + offset, minilm=8001 + offset, prometheus=9099 + offset,
                   metrics={k: v + 10 + offset for k, v in DEFAULT_PORTS.items() if k != "gateway"})

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.services[name]}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis}/0"

    @property
    def gateway_redis_port(self) -> int:
        return self.redis if self.gateway_redis is None else self.gateway_redis

    @property
    def gateway_redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.gateway_redis_port}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.services['gateway']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus}"

    def metrics_env(self, name: str) -> dict[str, str]:
        """EXAMLOPS_METRICS_PORT of the process that serves `name` (not in service_env: a second
        process started from a service's environment would find the port taken)."""
        return {"EXAMLOPS_METRICS_PORT": str(self.metrics[name])} if name in self.metrics else {}


def redis_argv(exe: str, port: int, data: Path, fsync: str) -> list[str]:
    """One Redis as the stack runs it: AOF on, no snapshots, `fsync` its appendfsync policy (always for
    the registry's, everysec for the gateway's: GOVERNANCE.md, Durability)."""
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
            "--appendfsync", fsync, "--save", "", "--daemonize", "no"]


#: Services that call other services, each with its own token (the others only answer).
CALLING_SERVICES = ("gateway", "launcher", "engine-proxy")
#: In a run directory: the name=token list every server accepts, and the operator's own token.
TOKENS_FILE = "internal-tokens"
OPERATOR_TOKEN_FILE = "operator-token"


@dataclass(frozen=True)
class StackTokens:
    """The credentials of one local stack: one per calling service, one for the operator (exa)."""

    path: Path                 # the accepted list, EXAMLOPS_INTERNAL_TOKENS_FILE of every server
    tokens: dict[str, str]     # name -> token
    operator: str              # the operator's name, cli:<user>

    @property
    def operator_token(self) -> str:
        return self.tokens[self.operator]


def stack_tokens(run_dir: Path, operator: str | None = None) -> StackTokens:
    """The stack's tokens, generated on first use into `run_dir` (mode 0600) and reused after.

    `make up` and the tests' stacks call it; the CLI finds the operator's token in the same place.
    """
    operator = operator or OPERATOR_PREFIX + (os.environ.get("USER") or getpass.getuser())
    path = run_dir / TOKENS_FILE
    tokens = parse_tokens(path.read_text(), str(path)) if path.exists() else {}
    wanted = [*CALLING_SERVICES, operator]
    if any(name not in tokens for name in wanted):
        tokens = {name: tokens.get(name) or secrets.token_urlsafe(32) for name in {*tokens, *wanted}}
        _write_private(path, "".join(f"{n}={t}\n" for n, t in sorted(tokens.items())))
    _write_private(run_dir / OPERATOR_TOKEN_FILE, tokens[operator] + "\n")
    return StackTokens(path=path, tokens=tokens, operator=operator)


def _write_private(path: Path, text: str) -> None:
    """Write `text` readable by its owner only, from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def service_env(name: str, ports: StackPorts, extra: dict[str, str] | None = None,
                tokens: StackTokens | None = None) -> dict[str, str]:
    """Environment for one service (and for the CLI when name is 'cli')."""
    env = {
        "EXAMLOPS_REDIS_URL": ports.redis_url,
        "EXAMLOPS_REGISTRY_ADDR": ports.addr("registry"),
        "EXAMLOPS_LAUNCHER_ADDR": ports.addr("launcher"),
        "EXAMLOPS_MEDIAGUARD_ADDR": ports.addr("mediaguard"),
        "EXAMLOPS_ENGINE_PROXY_ADDR": ports.addr("engine-proxy"),
        "EXAMLOPS_GATEWAY_URL": ports.gateway_url,
        # A development stack: the gateway accepts the well-known dev admin key only here.
        "EXAMLOPS_DEV_MODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if ports.gateway_redis is not None:
        env["EXAMLOPS_GATEWAY_REDIS_URL"] = ports.gateway_redis_url
    if name in ports.services:
        env["EXAMLOPS_PORT"] = str(ports.services[name])
    if tokens is not None:
        env[TOKENS_FILE_VAR] = str(tokens.path)
        if name in tokens.tokens:
            env[SERVICE_TOKEN_VAR] = tokens.tokens[name]
        if name == "cli":
            env[OPERATOR_TOKEN_VAR] = tokens.operator_token
    return {**env, **otel_env(), **(extra or {})}


def otel_env() -> dict[str, str]:
    """OpenTelemetry's variables of this process (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER...),
    passed on to every service: `OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 make up` traces."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


def service_argv(name: str) -> list[str]:
    return [sys.executable, "-m", SERVICES[name]]
