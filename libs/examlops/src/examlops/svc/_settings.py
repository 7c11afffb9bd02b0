"""Settings base: every service reads `EXAMLOPS_*` variables once, at start-up, and fails fast."""

from __future__ import annotations

import sys
from typing import TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ._auth import Access, ServerAuth, TokenError, load_accepted_tokens, token_problem
from ._redact import redact_setting

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
    service_token: SecretStr = Field(
        default=SecretStr(""),
        description="This service's own bearer token, sent on every call to another service "
                    "(its peers list it in EXAMLOPS_INTERNAL_TOKENS under this service's name).",
    )

    @field_validator("service_token")
    @classmethod
    def _usable_token(cls, value: SecretStr) -> SecretStr:
        problem = token_problem(value.get_secret_value()) if value.get_secret_value() else None
        if problem:
            raise ValueError(f"the token {problem}")
        return value


class GrpcServiceSettings(ServiceSettings):
    """Settings of a gRPC server: who may call it."""

    internal_tokens: SecretStr = Field(
        default=SecretStr(""),
        description="Callers this server accepts, as name=token pairs (comma- or newline-separated); "
                    "names starting with cli: are operators.")
    internal_tokens_file: str = Field(
        default="", description="A file of name=token lines, read at start-up (a mounted Secret).")

    @model_validator(mode="after")
    def _callers_are_listed(self) -> GrpcServiceSettings:
        try:
            load_accepted_tokens(self.internal_tokens.get_secret_value(), self.internal_tokens_file,
                                 required=False)
        except TokenError as exc:
            raise ValueError(str(exc)) from None
        return self


def server_auth(settings: GrpcServiceSettings, service: str, access: Access) -> ServerAuth:
    """The authentication of one server, from its settings; exits 2 naming the variables when the
    server would accept no caller (settings alone may be built without, e.g. to render job scripts)."""
    try:
        tokens = load_accepted_tokens(settings.internal_tokens.get_secret_value(), settings.internal_tokens_file)
    except TokenError as exc:
        sys.stderr.write(f"invalid setting {exc}\n")
        raise SystemExit(2) from None
    return ServerAuth(service, tokens, access)


S = TypeVar("S", bound=BaseSettings)


def settings_error_lines(exc: ValidationError, prefix: str = ENV_PREFIX,
                         cls: type[BaseSettings] | None = None) -> list[str]:
    """One line per invalid variable, naming it as the operator sets it.

    The value is shown only when it is no secret, with URL passwords masked; a check across
    several settings shows none (its input is every setting, the admin key included).
    """
    lines = []
    for err in exc.errors():
        if not err["loc"]:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        name = prefix + "_".join(str(p) for p in err["loc"]).upper()
        field = cls.model_fields.get(str(err["loc"][0])) if cls is not None else None
        secret = field is not None and field.annotation is SecretStr
        lines.append(f"{name}: {err['msg']} (got {redact_setting(name, err.get('input'), secret)})")
    return lines


def load_settings(cls: type[S]) -> S:
    """Build the settings from the environment or exit 2 naming each bad variable."""
    try:
        return cls()
    except ValidationError as exc:
        for line in settings_error_lines(exc, cls=cls):
            sys.stderr.write(f"invalid setting {line}\n")
        raise SystemExit(2) from None
