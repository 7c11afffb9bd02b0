"""gRPC server and client helpers shared by every service."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import propagate, trace

from ._auth import ServerAuth, bearer_metadata
from ._guard import Guard, GuardedServer
from ._tracing import shutdown_tracing, tracing_enabled
from ._wire import PARAM_KEY, REASON_KEY

log = logging.getLogger(__name__)


MAX_CONNECTION_AGE_MS = 60_000
MAX_CONNECTION_AGE_GRACE_MS = 900_000


def build_grpc_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    auth: ServerAuth,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server with health, reflection, metrics, caller authentication (`auth`) and, when
    tracing is on, a SERVER span per call (svc._guard: each handler `register` adds is wrapped once).

    Returns it with its bound port; port=0 binds a free port (tests use that). Refused calls are
    counted too. `reuse_port` lets several worker processes listen on one port (SO_REUSEPORT;
    run_workers checks the port first).
    """
    real = grpc.aio.server(options=[
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        # Clients reconnect every minute (in-flight calls finish first, a generation's read timeout
        # is 600 s): behind a Kubernetes Service, pods added by a scale-out get calls within a minute.
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ])
    tracer = trace.get_tracer("examlops.svc.grpc") if tracing_enabled() else None
    server = GuardedServer(real, Guard(auth, tracer))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    server.count_unknown_methods()
    bound = real.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    return real, bound, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    service_names: Iterable[str],
    name: str,
    port: int,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    on_drain: Callable[[], None] | None = None,
) -> None:
    """Start, mark SERVING, wait for SIGTERM/SIGINT, then drain in-flight calls and stop (`on_drain`
    is told first: long-lived streams that take new calls stop taking them)."""
    await server.start()
    if on_start is not None:
        await on_start()
    for svc in ["", *service_names]:
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s listening on port %d", name, port)
    # One line on stdout that process supervisors and tests can wait for.
    print(f"{name} ready on port {port}", flush=True)  # noqa: T201
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s shutting down", name)
    await health_servicer.enter_graceful_shutdown()
    if on_drain is not None:
        on_drain()
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
    shutdown_tracing()  # export the last batched spans


async def abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str, param: str = ""
) -> NoReturn:
    """End the call with a status code and the machine-readable reason in trailing metadata."""
    context.set_trailing_metadata(((REASON_KEY, reason), (PARAM_KEY, param)))
    await context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def error_reason(exc: grpc.aio.AioRpcError) -> tuple[str, str]:
    """The (reason, param) a server attached to an error; empty strings when none."""
    meta = dict(exc.trailing_metadata() or ())
    return str(meta.get(REASON_KEY, "")), str(meta.get(PARAM_KEY, ""))


class _WithMetadata:
    """A multi-callable whose every call carries the channel's metadata (and, with tracing on, the
    current trace context) ahead of the caller's own: what the bearer and trace-context
    interceptors did, without the interceptor machinery's extra task and call objects per call."""

    __slots__ = ("inner", "metadata")

    def __init__(self, inner: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self.inner, self.metadata = inner, metadata

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        sent = self.metadata
        if tracing_enabled():
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            sent = (*sent, *carrier.items())
        if metadata:
            sent = (*sent, *tuple(metadata))
        return self.inner(request, metadata=sent, **kwargs)


class _MetadataChannel(grpc.aio.Channel):
    """A grpc.aio channel that sends `metadata` on every call (see _WithMetadata)."""

    def __init__(self, inner: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self.inner, self.metadata = inner, metadata

    async def __aenter__(self) -> _MetadataChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.inner.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self.inner.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.inner.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.inner.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.inner.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self.inner.unary_unary(*args, **kwargs), self.metadata)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self.inner.unary_stream(*args, **kwargs), self.metadata)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self.inner.stream_unary(*args, **kwargs), self.metadata)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self.inner.stream_stream(*args, **kwargs), self.metadata)


def insecure_channel(addr: str, token: str) -> grpc.aio.Channel:
    """One long-lived channel per peer; every call carries `token` (the caller's EXAMLOPS_SERVICE_TOKEN).

    The transport is plaintext (TLS, where wanted, is the mesh's or the proxy's job); the token is
    what the peer authenticates. With tracing on, calls carry the current trace context too. Both
    go in each call's metadata (_MetadataChannel), not through client interceptors.
    """
    inner = grpc.aio.insecure_channel(addr, options=[
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", 1),
    ])
    return _MetadataChannel(inner, (bearer_metadata(token),))
