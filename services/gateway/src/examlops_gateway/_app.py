"""Gateway process: `create_app()` builds the FastAPI app from settings; `main()` runs uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from examlops.engineproxy.v1 import engineproxy_pb2_grpc as ep_grpc
from examlops.svc import RouteTable, configure_logging, insecure_channel, load_settings, watch_routes

from ._errors import install_error_handlers
from ._openai import router as openai_router
from ._settings import GatewaySettings
from ._state import GatewayState


def build_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        routes = RouteTable.empty()
        channel = insecure_channel(settings.engine_proxy_addr)
        app.state.gateway = GatewayState(
            settings=settings, routes=routes, engine_proxy=ep_grpc.EngineProxyStub(channel),
            channel=channel, admin_key=settings.admin_key.get_secret_value().encode())
        watcher = asyncio.create_task(watch_routes(settings.registry_addr, routes))
        try:
            yield
        finally:
            watcher.cancel()
            await channel.close()

    app = FastAPI(title="ExaMLOps gateway", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(openai_router)

    @app.get("/healthz")
    async def healthz() -> Response:
        state: GatewayState = app.state.gateway
        synced = state.routes.synced.is_set()
        body = {"status": "ok" if synced else "starting", "routes": len(state.routes.routable()),
                "route_table_synced": synced}
        return Response(orjson.dumps(body), status_code=200 if synced else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def create_app() -> FastAPI:
    """uvicorn factory (`--factory`): settings from the environment."""
    return build_app(load_settings(GatewaySettings))


def main() -> None:
    settings = load_settings(GatewaySettings)
    configure_logging(settings.log_level, "gateway")
    uvicorn.run("examlops_gateway._app:create_app", factory=True, host=settings.host, port=settings.port,
                workers=settings.workers, loop="uvloop", http="httptools", access_log=False,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=10)
