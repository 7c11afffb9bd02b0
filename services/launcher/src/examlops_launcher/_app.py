"""Launcher process."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import start_http_server

from examlops.launcher.v1 import launcher_pb2_grpc as pb_grpc
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import (
    OPERATORS,
    Access,
    build_grpc_server,
    configure_logging,
    insecure_channel,
    load_settings,
    serve_until_signal,
    server_auth,
    setup_tracing,
)

from ._adapters import build_adapters
from ._service import LauncherServicer
from ._settings import LauncherSettings

SERVICE = "examlops.launcher.v1.Launcher"
#: Only operators (exa, make up) start, probe and stop endpoints.
ACCESS = Access({OPERATORS: None})


async def run(settings: LauncherSettings) -> None:
    auth = server_auth(settings, "launcher", ACCESS)  # first: refuse to start accepting no caller
    channel = insecure_channel(settings.registry_addr, settings.service_token.get_secret_value())
    http = httpx.AsyncClient()
    adapters = build_adapters(settings)
    servicer = LauncherServicer(settings, reg_grpc.RegistryStub(channel), http, adapters)
    server, port, health = build_grpc_server(
        settings.host, settings.port, lambda s: pb_grpc.add_LauncherServicer_to_server(servicer, s), [SERVICE],
        auth)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)

    async def stop() -> None:
        for adapter in adapters.values():
            await adapter.close()
        await http.aclose()
        await channel.close()

    await serve_until_signal(server, health, [SERVICE], "launcher", port, on_stop=stop)


def main() -> None:
    settings = load_settings(LauncherSettings)
    configure_logging(settings.log_level, "launcher")
    setup_tracing("launcher")
    asyncio.run(run(settings))
