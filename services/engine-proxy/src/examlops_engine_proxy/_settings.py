from __future__ import annotations

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, GrpcServiceSettings


class EngineProxySettings(GrpcServiceSettings):
    """Engine-proxy settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["engine-proxy"], ge=0, le=65535,
                      description="gRPC port of engine-proxy.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}",
                               description="Registry gRPC address; its watch feeds the route table.")
    mediaguard_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['mediaguard']}",
                                 description="Mediaguard gRPC address, called for requests with media.")
    vllm_base_url: str = Field(default="",
                               description="Server for pack models that have no engine.base_url.")
    usecase_dir: str = Field(default="", description="Use-case packs; their models answer without a "
                                                     "registration (EXAMLOPS_USECASE_DIR).")
    connect_timeout_s: float = Field(default=3.0, gt=0, description="Connect timeout to an engine.")
    read_timeout_s: float = Field(default=600.0, gt=0,
                                  description="Longest silence from an engine before the call fails.")
    max_connections_per_endpoint: int = Field(default=256, ge=1,
                                              description="HTTP connection pool size per endpoint.")
