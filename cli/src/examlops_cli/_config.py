"""Where the CLI finds the stack: `EXAMLOPS_*` variables, defaulting to what `make up` starts."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from examlops.svc import DEFAULT_ADMIN_KEY, DEFAULT_PORTS


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXAMLOPS_", extra="ignore", frozen=True)

    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}")
    launcher_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['launcher']}")
    engine_proxy_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['engine-proxy']}")
    mediaguard_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['mediaguard']}")
    gateway_url: str = Field(default=f"http://127.0.0.1:{DEFAULT_PORTS['gateway']}")
    admin_key: SecretStr = Field(default=SecretStr(DEFAULT_ADMIN_KEY))
    actor: str = Field(default="", description="Who the audit trail names; defaults to the OS user.")
    rpc_timeout_s: float = Field(default=15.0, gt=0)
