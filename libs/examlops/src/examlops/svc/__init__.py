"""Helpers every service shares: settings, gRPC server and errors, the watched route table."""

from ._grpc import (
    PARAM_KEY,
    REASON_KEY,
    abort,
    build_grpc_server,
    error_reason,
    insecure_channel,
    serve_until_signal,
)
from ._logging import configure_logging
from ._routes import (
    ADDRESSLESS_ENGINES,
    RouteTable,
    parse_state,
    state_name,
    unroutable_reason,
    watch_routes,
)
from ._settings import DEFAULT_ADMIN_KEY, DEFAULT_PORTS, ServiceSettings, load_settings, settings_error_lines

__all__ = [
    "ADDRESSLESS_ENGINES",
    "DEFAULT_ADMIN_KEY",
    "DEFAULT_PORTS",
    "PARAM_KEY",
    "REASON_KEY",
    "RouteTable",
    "ServiceSettings",
    "abort",
    "build_grpc_server",
    "configure_logging",
    "error_reason",
    "insecure_channel",
    "load_settings",
    "parse_state",
    "serve_until_signal",
    "settings_error_lines",
    "state_name",
    "unroutable_reason",
    "watch_routes",
]
