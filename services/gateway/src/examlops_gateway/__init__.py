"""Gateway service: the OpenAI-compatible front of every registered endpoint."""

import examlops.grpcenv  # noqa: F401  (first: gRPC core reads its settings when grpc is imported)

from ._app import build_app, create_app, main
from ._settings import GatewaySettings

__all__ = ["GatewaySettings", "build_app", "create_app", "main"]
