from __future__ import annotations

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, GrpcServiceSettings


class RegistrySettings(GrpcServiceSettings):
    """Registry settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["registry"], ge=0, le=65535,
                      description="gRPC port of the registry.")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0",
                           description="Redis holding endpoints, change events and audit events: "
                                       "redis://host:port/db, or redis+cluster://host:port[,host:port...] "
                                       "for a Redis Cluster (rediss:// and rediss+cluster:// with TLS).")
    require_aof: bool = Field(default=True,
                              description="Refuse to start when Redis reports appendonly off.")
