"""Gateway service: the OpenAI-compatible front of every registered endpoint."""

from ._app import build_app, create_app, main
from ._settings import GatewaySettings

__all__ = ["GatewaySettings", "build_app", "create_app", "main"]
