"""Bearer-key authentication: the admin key, or a virtual key (checked in Redis by reserve.lua)."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from ._errors import OpenAIError
from ._governor import Caller
from ._keys import ADMIN_ID, digest, parse_key
from ._state import GatewayState


def bearer_key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key.strip()


def _invalid() -> OpenAIError:
    return OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def identify(request: Request, state: GatewayState) -> Caller:
    """Who calls, without I/O: the admin key, or a well-formed virtual key still to be checked."""
    key = bearer_key(request)
    if hmac.compare_digest(key.encode(), state.admin_key):
        return Caller(ADMIN_ID)
    key_id = parse_key(key)
    if key_id is None:
        raise _invalid()
    return Caller(key_id, digest(key))


def require_admin(request: Request, state: GatewayState) -> None:
    """The admin API answers the admin key only."""
    if not identify(request, state).admin:
        raise OpenAIError(403, "the admin API needs the admin key", type="permission_error",
                          code="admin_key_required")


def authenticate(request: Request, state: GatewayState) -> str:
    """The caller's identity for reads (model listing); virtual keys are checked by reserve.lua on use."""
    return identify(request, state).key_id
