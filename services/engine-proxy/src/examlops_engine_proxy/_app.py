"""Engine-proxy process: settings → route table (registry watch) → gRPC server.

With EXAMLOPS_WORKERS=N > 1 the process is a parent that runs N such servers on one port
(svc.run_workers): each worker has its own route watch, engine pools, replica scrapes and in-flight
counts, so least-load routing sees its own worker's calls in flight plus the servers' scraped load.
Every server runs on uvloop: grpc aio and aiohttp both work on it, and the event loop's share of a
call's CPU is about a fifth smaller than asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import functools

import uvloop

from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as mg_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import (
    OPERATORS,
    Access,
    RouteTable,
    WorkerSlot,
    build_grpc_server,
    configure_logging,
    insecure_channel,
    load_settings,
    run_workers,
    serve_metrics,
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


async def run(settings: EngineProxySettings, slot: WorkerSlot | None = None) -> None:
    """One server; as a worker (`slot`), on the shared port with SO_REUSEPORT and no metrics
    exporter of its own (the parent serves every worker's)."""
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
        settings.host, slot.port if slot else settings.port,
        lambda s: pb_grpc.add_EngineProxyServicer_to_server(servicer, s), [SERVICE], auth, reuse_port=slot is not None)
    if settings.metrics_port and slot is None:
        serve_metrics(settings.host, settings.metrics_port)
    tasks = [asyncio.create_task(watch_routes(settings.registry_addr, table, on_change, token=token))]

    async def start() -> None:
        if slot is not None:
            tasks.append(asyncio.create_task(slot.follow_parent()))
            slot.started()

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await pool.aclose()
        await mg_channel.close()

    await serve_until_signal(server, health, [SERVICE], "engine-proxy", port, on_start=start, on_stop=stop,
                             on_drain=servicer.drain)


def run_worker(settings: EngineProxySettings, slot: WorkerSlot) -> None:
    """A worker process's life (run_workers starts it): its own logging, tracing and server."""
    configure_logging(settings.log_level, f"engine-proxy[{slot.index}]")
    setup_tracing("engine-proxy")
    uvloop.run(run(settings, slot))


def main() -> None:
    settings = load_settings(EngineProxySettings)
    configure_logging(settings.log_level, "engine-proxy")
    if settings.workers > 1:
        server_auth(settings, "engine-proxy", ACCESS)  # a caller-less setting stops the parent, not N workers
        raise SystemExit(run_workers("engine-proxy", settings.workers, settings.host, settings.port,
                                     settings.metrics_port, functools.partial(run_worker, settings)))
    setup_tracing("engine-proxy")
    uvloop.run(run(settings))
