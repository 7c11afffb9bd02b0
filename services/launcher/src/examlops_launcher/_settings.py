from __future__ import annotations

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, ServiceSettings


class LauncherSettings(ServiceSettings):
    """Launcher settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["launcher"], ge=0, le=65535, description="gRPC port of the launcher.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}", description="Registry gRPC address.")
    probe_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one health probe of a server.")
