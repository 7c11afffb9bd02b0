"""gRPC stubs for the CLI, with deadlines and errors turned into one clear line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import blocking_channel

from ._output import Ctx, fail
from ._token import operator_token

T = TypeVar("T")

_SERVICES: dict[str, tuple[str, Callable[[grpc.Channel], Any]]] = {
    "registry": ("registry_addr", reg_grpc.RegistryStub),
    "launcher": ("launcher_addr", la_grpc.LauncherStub),
    "engine-proxy": ("engine_proxy_addr", ep_grpc.EngineProxyStub),
}
_channels: dict[str, grpc.Channel] = {}


def stub(service: str) -> Any:
    attr, factory = _SERVICES[service]
    addr = getattr(Ctx.settings(), attr)
    if addr not in _channels:
        _channels[addr] = blocking_channel(addr, operator_token())
    return factory(_channels[addr])


def call(service: str, method: str, request: Any, timeout: float | None = None) -> Any:
    """Unary call; on failure print the server's message (or how to reach it) and exit 1."""
    try:
        return getattr(stub(service), method)(request, timeout=timeout or Ctx.settings().rpc_timeout_s)
    except grpc.RpcError as exc:
        rpc_fail(service, exc)


def rpc_fail(service: str, exc: grpc.RpcError) -> Any:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and not _has_reason(exc):
        attr = _SERVICES[service][0]
        fail(f"cannot reach {service} at {getattr(Ctx.settings(), attr)} "
             f"(is the stack up? `make up`; or set EXAMLOPS_{attr.upper()})")
    fail(exc.details() or code.name)


def _has_reason(exc: grpc.RpcError) -> bool:
    meta = dict(exc.trailing_metadata() or ())
    return bool(meta.get("examlops-reason"))
