"""The operator's credential for the gRPC services, found the way the stack is found.

EXAMLOPS_OPERATOR_TOKEN, else the file EXAMLOPS_OPERATOR_TOKEN_FILE, else the token `make up`
generated for the stack running from this checkout (.run/operator-token, found from the current
directory upwards, like .run/port-offset). Empty when there is none: the server's refusal then
names the variable to set.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Written (mode 0600) by `make up` (python -m examlops_devstack) into its run dir.
OPERATOR_TOKEN_FILE = Path(".run") / "operator-token"


class TokenSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXAMLOPS_", extra="ignore", frozen=True)

    operator_token: SecretStr = Field(default=SecretStr(""),
                                      description="The operator's bearer token for the gRPC services.")
    operator_token_file: str = Field(default="", description="A file holding the operator's token.")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def operator_token(start: Path | None = None) -> str:
    settings = TokenSettings()
    if settings.operator_token.get_secret_value():
        return settings.operator_token.get_secret_value()
    if settings.operator_token_file:
        return _read(Path(settings.operator_token_file))
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        token = _read(folder / OPERATOR_TOKEN_FILE)
        if token:
            return token
    return ""
