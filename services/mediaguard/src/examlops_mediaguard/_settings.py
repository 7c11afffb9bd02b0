from __future__ import annotations

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, GrpcServiceSettings


class MediaGuardSettings(GrpcServiceSettings):
    """Mediaguard settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["mediaguard"], ge=0, le=65535, description="gRPC port of mediaguard.")
