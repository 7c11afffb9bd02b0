"""What the gateway holds for its lifetime: settings, the route table, the engine-proxy stub."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from examlops.engineproxy.v1 import engineproxy_pb2_grpc as ep_grpc
from examlops.svc import RouteTable

from ._settings import GatewaySettings


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    routes: RouteTable
    engine_proxy: ep_grpc.EngineProxyStub
    channel: grpc.aio.Channel
    admin_key: bytes
