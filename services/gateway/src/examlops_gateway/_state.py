"""What the gateway holds for its lifetime: settings, the route table, peers' stubs, Redis, prices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import redis.asyncio as redis

from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import RouteTable

from ._multiplex import EngineMultiplex
from ._settings import GatewaySettings
from .cache import CacheStage
from .governance import Governor, KeyCheck, PriceBook
from .guardrails import GuardStage

if TYPE_CHECKING:  # _health's routes read this state
    from ._health import RedisPing


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    routes: RouteTable
    engine_proxy: ep_grpc.EngineProxyStub
    channel: grpc.aio.Channel
    admin_key: bytes
    registry: reg_grpc.RegistryStub
    registry_channel: grpc.aio.Channel
    redis: redis.Redis
    prices: PriceBook
    governor: Governor
    replica_id: str
    redis_ping: RedisPing        # readiness: does Redis answer (its own connection)
    key_check: KeyCheck          # a virtual key is valid before its body is read
    guard: GuardStage            # the guardrail policies in force (refreshed from Redis)
    cache: CacheStage            # the response cache's policies (refreshed from Redis) and semantic index
    multiplex: EngineMultiplex    # the hot path's calls to engine-proxy (Multiplex streams on `channel`)
