"""Registry process: settings → Redis → gRPC server."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as redis
from prometheus_client import start_http_server
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from examlops.registry.v1 import registry_pb2 as pb
from examlops.registry.v1 import registry_pb2_grpc as pb_grpc
from examlops.svc import (
    OPERATORS,
    Access,
    RedisUnavailable,
    RedisUrlError,
    ServerAuth,
    build_grpc_server,
    configure_logging,
    load_settings,
    ping_redis,
    redis_client,
    redis_primaries,
    serve_until_signal,
    server_auth,
    setup_tracing,
)

from ._service import RegistryServicer
from ._settings import RegistrySettings
from ._store import RegistryStore

log = logging.getLogger(__name__)
SERVICE = "examlops.registry.v1.Registry"
#: What only an operator may change: the keys the registry trusts, the model versions, their evals
#: and aliases, and judge calibrations. Services may read them.
OPERATOR_ONLY = frozenset({"AddTrustedKey", "RemoveTrustedKey", "RegisterModelVersion", "RecordEval", "Promote",
                           "RecordJudgeCalibration"})
SERVICE_RPCS = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["Registry"].methods) - OPERATOR_ONLY
#: Operators, the gateway (prices, audit, key attribution) and the launcher change records;
#: engine-proxy only reads the route table.
ACCESS = Access({
    OPERATORS: None, "gateway": SERVICE_RPCS, "launcher": SERVICE_RPCS,
    "engine-proxy": frozenset({"WatchEndpoints", "GetEndpoint", "ListEndpoints"}),
})


async def check_durability(client: redis.Redis, require_aof: bool) -> None:
    """Registrations are acknowledged only once Redis has them in an fsynced AOF (on a cluster: every
    primary, as the slot of {exa:reg} may move to any of them)."""
    try:
        confs = [await client.config_get("append*", **({"target_nodes": node} if node else {}))
                 for node in redis_primaries(client) or [None]]
    except redis.ResponseError:
        log.warning("cannot read Redis config; make sure appendonly yes, appendfsync always")
        return
    aof = "yes" if all(c.get("appendonly") == "yes" for c in confs) else "no"
    fsync = next((c.get("appendfsync") for c in confs if c.get("appendfsync") != "always"), "always")
    if aof != "yes":
        msg = ("Redis runs with appendonly=no: acknowledged registrations would be lost on a "
               "restart. Start Redis with --appendonly yes --appendfsync always")
        if require_aof:
            raise SystemExit(msg + " (or set EXAMLOPS_REQUIRE_AOF=false for a throwaway store)")
        log.warning(msg)
    elif fsync != "always":
        log.warning("Redis appendfsync=%s: a power loss may drop the last second of changes", fsync)


def build_server(settings: RegistrySettings, client: redis.Redis,
                 auth: ServerAuth) -> tuple[grpc.aio.Server, int, object]:
    servicer = RegistryServicer(RegistryStore(client))
    return build_grpc_server(
        settings.host, settings.port,
        lambda s: pb_grpc.add_RegistryServicer_to_server(servicer, s), [SERVICE], auth)


async def run(settings: RegistrySettings) -> None:
    auth = server_auth(settings, "registry", ACCESS)
    # A Redis restart leaves dead pooled connections: retry once connected again, briefly. No socket
    # timeout: WatchEndpoints blocks in XREAD for 10 s at a time (a cluster client's default is 5 s).
    try:
        client = redis_client(settings.redis_url, health_check_interval=30,
                              retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6),
                              retry_on=(redis.ConnectionError, redis.TimeoutError))
        await ping_redis(client, settings.redis_url)
    except (RedisUrlError, RedisUnavailable) as exc:
        raise SystemExit(str(exc)) from None
    await check_durability(client, settings.require_aof)
    server, port, health = build_server(settings, client, auth)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    await serve_until_signal(server, health, [SERVICE], "registry", port, on_stop=client.aclose)


def main() -> None:
    settings = load_settings(RegistrySettings)
    configure_logging(settings.log_level, "registry")
    setup_tracing("registry")
    asyncio.run(run(settings))
