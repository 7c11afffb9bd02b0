"""Real parts for the tests: a Redis server and each service as its own process on free ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from redis.cluster import ClusterNode, RedisCluster

from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import blocking_channel, is_cluster_url
from examlops_devstack import (
    SERVICES,
    Proc,
    StackPorts,
    StackTokens,
    free_port,
    redis_argv,
    service_argv,
    service_env,
    spawn,
    stack_tokens,
    wait_grpc,
    wait_http,
)
from examlops_testsupport.redis_cluster import RedisClusterServer

#: The operator credential of the tests' stacks (what their audit events name).
TEST_OPERATOR = "cli:tests"


@dataclass
class RedisServer:
    port: int
    dir: Path
    proc: Proc

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)


def start_redis(workdir: Path, port: int | None = None, fsync: str = "always") -> RedisServer:
    """A Redis as `make up` runs it (AOF on), appendfsync `fsync`: always for the registry's, everysec for
    the gateway's own (running_stack's `gateway_redis`)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: run `make test` (it installs Debian's redis-server)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = spawn("redis", redis_argv(exe, port, workdir, fsync), {}, workdir / "redis.log")
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or not proc.alive():
                raise RuntimeError(f"redis did not start:\n{proc.log_tail()}") from None
            time.sleep(0.02)
    return RedisServer(port, workdir, proc)


@dataclass
class Stack:
    ports: StackPorts
    workdir: Path
    tokens: StackTokens
    procs: dict[str, Proc] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def gateway_url(self) -> str:
        return self.ports.gateway_url

    def env(self, name: str = "cli") -> dict[str, str]:
        return service_env(name, self.ports, self.extra_env, tokens=self.tokens)

    def redis_client(self) -> redis.Redis | RedisCluster:
        """A client of the stack's Redis (a RedisCluster when the services run on one), replies decoded."""
        url = self.env()["EXAMLOPS_REDIS_URL"]
        if not is_cluster_url(url):
            return redis.Redis.from_url(url, decode_responses=True)
        seeds = [seed.rsplit(":", 1) for seed in url.removeprefix("redis+cluster://").split(",")]
        return RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in seeds], decode_responses=True)

    def start(self, name: str) -> Proc:
        proc = spawn(name, service_argv(name), {**self.env(name), **self.ports.metrics_env(name)},
                     self.workdir / f"{name}.log")
        self.procs[name] = proc
        if name == "gateway":
            wait_http(self.gateway_url + "/healthz", 30, proc)
        else:
            wait_grpc(self.ports.addr(name), 30, proc)
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        self.procs.pop(name).stop(sig)

    def start_gateway_replica(self, name: str, extra_env: dict[str, str] | None = None) -> tuple[Proc, str]:
        """Another gateway process on its own free port, sharing this stack's Redis and peers.

        It is stopped with the stack (it joins `procs` under `name`); returns it and its base URL.
        """
        port = free_port()
        env = {**self.env("gateway"), **(extra_env or {}), "EXAMLOPS_PORT": str(port)}
        proc = spawn(name, service_argv("gateway"), env, self.workdir / f"{name}.log")
        self.procs[name] = proc
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", 30, proc)
        return proc, url

    def channel(self, name: str, token: str | None = None) -> grpc.Channel:
        """A channel to service `name` sending `token` (default: the tests' operator token)."""
        return blocking_channel(self.ports.addr(name), self.tokens.operator_token if token is None else token)

    def registry(self) -> reg_grpc.RegistryStub:
        return reg_grpc.RegistryStub(self.channel("registry"))

    def register(self, name: str, **fields: object) -> reg.Endpoint:
        fields.setdefault("state", reg.ENDPOINT_STATE_READY)
        ep = reg.Endpoint(name=name, **fields)  # type: ignore[arg-type]
        out: reg.Endpoint = self.registry().RegisterEndpoint(
            reg.RegisterEndpointRequest(endpoint=ep, actor="tests", replace=True), timeout=10)
        return out

    def cli(self, *args: str, check: bool = False, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        exa = Path(sys.executable).parent / "exa"
        assert exa.exists(), f"the exa CLI is not installed beside {sys.executable}"

        return subprocess.run([str(exa), *args], capture_output=True, text=True, check=check, timeout=timeout,
                              env={**os.environ, **self.env(), "COLUMNS": "200", **(env or {})})


@contextlib.contextmanager
def running_stack(workdir: Path, redis_server: RedisServer | RedisClusterServer,
                  extra_env: dict[str, str] | None = None, gateway_redis: RedisServer | None = None) -> Iterator[Stack]:
    """The five services on free ports, on `redis_server` (a single Redis or a Redis Cluster); the gateway
    on `gateway_redis` when given (as `make up` runs it), else on `redis_server` too."""
    ports = StackPorts(redis=redis_server.port, gateway_redis=gateway_redis.port if gateway_redis else None,
                       services={n: free_port() for n in SERVICES},
                       metrics={n: free_port() for n in SERVICES if n != "gateway"})  # gateway: /metrics on its port
    env = {"EXAMLOPS_REDIS_URL": redis_server.url, **(extra_env or {})}
    stack = Stack(ports, workdir, stack_tokens(workdir, TEST_OPERATOR), extra_env=env)
    try:
        for name in SERVICES:
            stack.start(name)
        yield stack
    finally:
        for proc in reversed(list(stack.procs.values())):
            proc.stop()


def wait_until(check: object, timeout_s: float = 5.0, interval_s: float = 0.02, what: str = "condition") -> float:
    """Poll `check()` until truthy; returns the seconds it took (AssertionError naming `what` on timeout)."""
    start = time.monotonic()
    while True:
        if check():  # type: ignore[operator]
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not met within {timeout_s:g} s")
        time.sleep(interval_s)


def ports_free(ports: StackPorts) -> bool:
    """No listener on any port of a stack's set (before `make up` is run on shifted ports)."""
    for port in [ports.redis, ports.gateway_redis_port, ports.vllm, ports.minilm, ports.prometheus,
                 *ports.services.values(), *ports.metrics.values()]:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True
