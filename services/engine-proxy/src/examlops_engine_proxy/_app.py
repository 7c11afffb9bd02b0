"""Engine-proxy process: settings → route table (registry watch) → gRPC server."""

from __future__ import annotations

import asyncio

from prometheus_client import start_http_server

from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as mg_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import (
    OPERATORS,
    Access,
    RouteTable,
    build_grpc_server,
    configure_logging,
    insecure_channel,
    load_settings,
    serve_until_signal,
    server_auth,
    setup_tracing,
    watch_routes,
)

from ._pool import EnginePool
from ._service import EngineProxyServicer
from ._settings import EngineProxySettings

SERVICE = "examlops.engine_proxy.v1.EngineProxy"
#: The gateway's traffic, and operators' direct line (exa serve llm chat).
ACCESS = Access({OPERATORS: None, "gateway": None})


async def run(settings: EngineProxySettings) -> None:
    auth = server_auth(settings, "engine-proxy", ACCESS)  # first: refuse to start accepting no caller
    table = RouteTable.empty()
    pool = EnginePool(settings)

    def on_change(ep: reg.Endpoint, deleted: bool) -> None:
        if deleted:
            pool.forget(ep.name)
        else:
            pool.refresh(ep)

    token = settings.service_token.get_secret_value()
    mg_channel = insecure_channel(settings.mediaguard_addr, token)
    servicer = EngineProxyServicer(settings, table, pool, mg_grpc.MediaGuardStub(mg_channel))
    server, port, health = build_grpc_server(
        settings.host, settings.port, lambda s: pb_grpc.add_EngineProxyServicer_to_server(servicer, s), [SERVICE],
        auth)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    watcher = asyncio.create_task(watch_routes(settings.registry_addr, table, on_change, token=token))

    async def stop() -> None:
        watcher.cancel()
        await pool.aclose()
        await mg_channel.close()

    await serve_until_signal(server, health, [SERVICE], "engine-proxy", port, on_stop=stop)


def main() -> None:
    settings = load_settings(EngineProxySettings)
    configure_logging(settings.log_level, "engine-proxy")
    setup_tracing("engine-proxy")
    asyncio.run(run(settings))
