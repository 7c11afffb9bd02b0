"""Mediaguard process: stateless, pure, never fetches media."""

from __future__ import annotations

import asyncio

from prometheus_client import start_http_server

from examlops.mediaguard.v1 import mediaguard_pb2_grpc as pb_grpc
from examlops.svc import (
    OPERATORS,
    Access,
    build_grpc_server,
    configure_logging,
    load_settings,
    serve_until_signal,
    server_auth,
    setup_tracing,
)

from ._service import MediaGuardServicer
from ._settings import MediaGuardSettings

SERVICE = "examlops.mediaguard.v1.MediaGuard"
#: engine-proxy checks every request that carries media; operators may check a part by hand.
ACCESS = Access({OPERATORS: None, "engine-proxy": None})


async def run(settings: MediaGuardSettings) -> None:
    auth = server_auth(settings, "mediaguard", ACCESS)  # first: refuse to start accepting no caller
    servicer = MediaGuardServicer()
    server, port, health = build_grpc_server(
        settings.host, settings.port, lambda s: pb_grpc.add_MediaGuardServicer_to_server(servicer, s), [SERVICE],
        auth)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    await serve_until_signal(server, health, [SERVICE], "mediaguard", port)


def main() -> None:
    settings = load_settings(MediaGuardSettings)
    configure_logging(settings.log_level, "mediaguard")
    setup_tracing("mediaguard")
    asyncio.run(run(settings))
