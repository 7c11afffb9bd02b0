"""Settings base: every service reads `EXAMLOPS_*` variables once, at start-up, and fails fast."""

from __future__ import annotations

import sys
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "EXAMLOPS_"

#: Dev defaults shared by the services, `make up`, compose and the CLI.
DEFAULT_PORTS = {
    "registry": 50051,
    "launcher": 50052,
    "mediaguard": 50053,
    "engine-proxy": 50054,
    "gateway": 8080,
}
DEFAULT_ADMIN_KEY = "exa-dev-admin-key"


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    host: str = Field(default="127.0.0.1", description="Address to listen on (0.0.0.0 in containers).")
    log_level: str = Field(default="INFO", description="Python log level of the service.")
    metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="Prometheus /metrics port for gRPC services; 0 disables the exporter.",
    )


S = TypeVar("S", bound=BaseSettings)


def settings_error_lines(exc: ValidationError, prefix: str = ENV_PREFIX) -> list[str]:
    """One line per invalid variable, naming it as the operator sets it."""
    lines = []
    for err in exc.errors():
        name = prefix + "_".join(str(p) for p in err["loc"]).upper()
        lines.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
    return lines


def load_settings(cls: type[S]) -> S:
    """Build the settings from the environment or exit 2 naming each bad variable."""
    try:
        return cls()
    except ValidationError as exc:
        for line in settings_error_lines(exc):
            sys.stderr.write(f"invalid setting {line}\n")
        raise SystemExit(2) from None
