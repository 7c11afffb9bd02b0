from __future__ import annotations

from pydantic import Field, SecretStr

from examlops.svc import DEFAULT_ADMIN_KEY, DEFAULT_PORTS, ServiceSettings


class GatewaySettings(ServiceSettings):
    """Gateway settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["gateway"], ge=0, le=65535, description="HTTP port of the gateway.")
    workers: int = Field(default=1, ge=1, le=64, description="uvicorn worker processes.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}",
                               description="Registry gRPC address; its watch feeds the route table.")
    engine_proxy_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['engine-proxy']}",
                                   description="Engine-proxy gRPC address (generation).")
    admin_key: SecretStr = Field(default=SecretStr(DEFAULT_ADMIN_KEY),
                                 description="Bearer key with every right; change it outside dev.")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0,
                                description="Largest request body accepted (413 above it).")
    request_timeout_s: float = Field(default=600.0, gt=0,
                                     description="Deadline of one generation through engine-proxy.")
