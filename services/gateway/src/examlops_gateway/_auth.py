"""Bearer-key authentication (the admin key until virtual keys exist)."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from ._errors import OpenAIError
from ._state import GatewayState


def bearer_key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key.strip()


def authenticate(request: Request, state: GatewayState) -> str:
    """The caller's identity; 401 in OpenAI's shape otherwise."""
    key = bearer_key(request)
    if hmac.compare_digest(key.encode(), state.admin_key):
        return "admin"
    raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                      headers={"WWW-Authenticate": "Bearer"})
