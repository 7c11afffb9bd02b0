"""Where the CLI finds the stack: `EXAMLOPS_*` variables, defaulting to what `make up` starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from examlops.svc import DEFAULT_ADMIN_KEY, DEFAULT_PORTS

#: Written by `make up` (python -m examlops_devstack) into its run dir, removed by `make down`.
PORT_OFFSET_FILE = Path(".run") / "port-offset"


def running_port_offset(start: Path | None = None) -> int:
    """The port offset of the stack `make up` runs from this checkout (found from the current
    directory upwards), 0 when none runs."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        try:
            return int((folder / PORT_OFFSET_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
    return 0


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXAMLOPS_", extra="ignore", frozen=True)

    dev_port_offset: int = Field(default=0, ge=0, description=(
        "Shift of every default port, as `make up` applies it; unset: the offset of the stack running "
        "from this checkout (.run/port-offset), else 0."))
    registry_addr: str = Field(default="", description="Registry gRPC address (default: the local stack's).")
    launcher_addr: str = Field(default="", description="Launcher gRPC address (default: the local stack's).")
    engine_proxy_addr: str = Field(default="", description="Engine-proxy gRPC address (default: the local stack's).")
    mediaguard_addr: str = Field(default="", description="Mediaguard gRPC address (default: the local stack's).")
    gateway_url: str = Field(default="", description="Gateway base URL (default: the local stack's).")
    admin_key: SecretStr = Field(default=SecretStr(DEFAULT_ADMIN_KEY))
    actor: str = Field(default="", description="Who the audit trail names; defaults to the OS user.")
    rpc_timeout_s: float = Field(default=15.0, gt=0)
    rag_dir: str = Field(default="", description=(
        "Where `exa rag` keeps its collections; default: ${XDG_DATA_HOME:-~/.local/share}/examlops/rag."))

    @model_validator(mode="before")
    @classmethod
    def _local_stack_defaults(cls, data: Any) -> Any:
        """Addresses not given explicitly are the local stack's, on its shifted ports."""
        if not isinstance(data, dict):
            return data
        offset = data.get("dev_port_offset")
        offset = running_port_offset() if offset in (None, "") else int(offset)
        port = {name: p + offset for name, p in DEFAULT_PORTS.items()}
        defaults = {
            "registry_addr": f"127.0.0.1:{port['registry']}",
            "launcher_addr": f"127.0.0.1:{port['launcher']}",
            "engine_proxy_addr": f"127.0.0.1:{port['engine-proxy']}",
            "mediaguard_addr": f"127.0.0.1:{port['mediaguard']}",
            "gateway_url": f"http://127.0.0.1:{port['gateway']}",
        }
        return {**defaults, **{k: v for k, v in data.items() if v not in (None, "")}, "dev_port_offset": offset}
