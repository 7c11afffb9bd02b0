"""Gateway process: `create_app()` builds the FastAPI app from settings; `main()` runs uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as redis
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio.retry import Retry
from starlette.responses import Response

from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import (
    PARENT_PID_VAR,
    RedisUnavailable,
    RedisUrlError,
    RouteTable,
    configure_logging,
    fastapi_telemetry,
    follow_parent,
    insecure_channel,
    load_settings,
    metrics_registry,
    multiprocess_metrics,
    ping_redis,
    redis_client,
    setup_tracing,
    watch_routes,
)

from ._health import RedisPing
from ._health import router as health_router
from ._multiplex import EngineMultiplex
from ._settings import GatewaySettings
from ._state import GatewayState
from .cache import CacheBook, CacheStage, SemanticIndex, embed
from .governance import REDIS_BACKOFF, REDIS_RETRIES, Governor, KeyCheck, PriceBook, Reaper, follow_prices, pipe_for
from .guardrails import GuardrailBook, GuardStage, engine_proxy_ask
from .http import (
    FastLaneApp,
    StateDep,
    admin_router,
    block_auditor,
    cache_admin_router,
    guardrails_admin_router,
    install_error_handlers,
    install_openapi,
    openai_router,
)

log = logging.getLogger(__name__)


def gateway_redis(settings: GatewaySettings) -> redis.Redis:
    """One pool per process (a Redis or a Redis Cluster); a call waits for a free connection rather
    than failing under a burst.

    A Redis restart leaves dead pooled connections: they are retried once connected again, briefly.
    """
    return redis_client(settings.store_url, max_connections=settings.redis_max_connections, wait_s=10,
                        health_check_interval=30, retry=Retry(REDIS_BACKOFF, retries=REDIS_RETRIES),
                        retry_on=(redis.ConnectionError,), var=settings.store_var)


def build_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            client = gateway_redis(settings)
        except RedisUrlError as exc:
            log.error("%s", exc)
            raise SystemExit(str(exc)) from None
        try:
            await ping_redis(client, settings.store_url, settings.store_var)
        except RedisUnavailable as exc:
            log.error("%s", exc)
            await client.aclose()
            raise SystemExit(str(exc)) from None
        replica_id = secrets.token_hex(6)
        routes = RouteTable.empty()
        token = settings.service_token.get_secret_value()  # what engine-proxy and the registry authenticate
        channel = insecure_channel(settings.engine_proxy_addr, token)
        registry_channel = insecure_channel(settings.registry_addr, token)
        registry = reg_grpc.RegistryStub(registry_channel)
        prices = PriceBook()
        engine_proxy = ep_grpc.EngineProxyStub(channel)
        pipe = pipe_for(settings.store_url)  # reserve and settle on one pipelined connection
        governor = Governor(settings, client, prices, replica_id, routes, pipe=pipe)
        reaper = Reaper(client, settings, replica_id, governor.watch)
        await reaper.start()  # alive before the first reservation; a warning if the store has no AOF
        guardrails = GuardrailBook(client, engine_proxy_ask(engine_proxy, governor), settings.guardrail_refresh_s)
        await guardrails.refresh()  # the policies in force before the first call
        cache_book = CacheBook(client, settings.cache_refresh_s)
        await cache_book.refresh()
        index = SemanticIndex(client, max_entries=settings.cache_max_entries,
                              sync_interval_s=settings.cache_index_sync_s)
        await index.start()
        app.state.gateway = GatewayState(
            settings=settings, routes=routes, engine_proxy=engine_proxy,
            channel=channel, admin_key=settings.admin_key.get_secret_value().encode(),
            registry=registry, registry_channel=registry_channel, redis=client, prices=prices,
            governor=governor, replica_id=replica_id,
            guard=GuardStage(guardrails, on_block=block_auditor(registry, governor.background)),
            redis_ping=RedisPing(settings.store_url),
            key_check=KeyCheck(client, settings.key_check_ttl_s, settings.key_check_cache_size),
            cache=CacheStage(cache_book, client, index, functools.partial(embed, engine_proxy),
                             settings.cache_embed_timeout_s),
            multiplex=EngineMultiplex(channel))
        tasks = [asyncio.create_task(watch_routes(settings.registry_addr, routes, token=token)),
                 asyncio.create_task(follow_prices(registry, prices, settings.price_refresh_s)),
                 asyncio.create_task(reaper.run()), asyncio.create_task(guardrails.follow()),
                 asyncio.create_task(cache_book.follow())]
        if parent := os.environ.get(PARENT_PID_VAR):  # a worker of main()'s: stop once that parent is gone
            tasks.append(asyncio.create_task(follow_parent(int(parent), "gateway worker")))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            pending = [*app.state.gateway.governor.background, *app.state.gateway.cache.background]
            if pending:
                await asyncio.wait(pending, timeout=5)
            await reaper.leave()
            if pipe is not None:
                await pipe.close()
            await index.aclose()
            app.state.gateway.multiplex.close()
            await channel.close()
            await registry_channel.close()
            for closing in (app.state.gateway.redis_ping, client):
                with contextlib.suppress(redis.RedisError):
                    await closing.aclose()

    app = FastLaneApp(title="ExaMLOps gateway", version="0.1.0", lifespan=lifespan,  # the hot routes: _fastlane
                      docs_url=None, redoc_url=None, telemetry=fastapi_telemetry())
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(admin_router)
    app.include_router(guardrails_admin_router)
    app.include_router(cache_admin_router)
    app.include_router(health_router)  # /livez, /readyz, /healthz (= /readyz)
    install_openapi(app)

    registry = metrics_registry()  # with several workers: every worker's samples, summed

    @app.get("/metrics", include_in_schema=False)
    async def metrics(state: StateDep) -> Response:
        await state.redis_ping.ok()  # the governance store's gauge as of this scrape
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def create_app() -> FastAPI:
    """uvicorn factory (`--factory`): settings from the environment; logging (a no-op in the single
    process, main() set it up) and tracing set up in each worker."""
    settings = load_settings(GatewaySettings)
    configure_logging(settings.log_level, "gateway")
    setup_tracing("gateway")
    return build_app(settings)


def main() -> None:
    """uvicorn with EXAMLOPS_WORKERS processes sharing the port; each worker is a gateway replica of
    its own (replica id, heartbeat, caches) and /metrics sums them all (svc.multiprocess_metrics)."""
    settings = load_settings(GatewaySettings)
    configure_logging(settings.log_level, "gateway")
    log.info("gateway: %d worker process%s on %s:%d", settings.workers, "es" if settings.workers > 1 else "",
             settings.host, settings.port)
    if settings.workers > 1:  # uvicorn's workers keep serving when it is killed: each follows it itself
        os.environ[PARENT_PID_VAR] = str(os.getpid())
    with multiprocess_metrics("gateway", settings.workers):
        uvicorn.run("examlops_gateway._app:create_app", factory=True, host=settings.host, port=settings.port,
                    workers=settings.workers, loop="uvloop", http="httptools", access_log=False,
                    log_level=settings.log_level.lower(), timeout_graceful_shutdown=10)
