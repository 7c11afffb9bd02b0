"""Typed dependencies of the handlers: the gateway's state, the caller's identity, the admin check.

The caller is identified without I/O: the admin key, or a well-formed virtual key whose record is
checked in Redis where it is used (reserve.lua on a generation, key_models.lua on /v1/models).
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from .._state import GatewayState
from ..governance import ADMIN_ID, Caller, digest, parse_key
from ._errors import OpenAIError


async def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(gateway_state)]


def _invalid_key(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def caller(request: Request, state: StateDep) -> Caller:
    """Who calls (401 when the Authorization header holds no well-formed key)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _invalid_key("missing API key: send 'Authorization: Bearer <key>'")
    if hmac.compare_digest(key.encode(), state.admin_key):
        return Caller(ADMIN_ID)
    key_id = parse_key(key)
    if key_id is None:
        raise _invalid_key("incorrect API key provided")
    return Caller(key_id, digest(key))


CallerDep = Annotated[Caller, Depends(caller)]


async def require_admin(who: CallerDep) -> None:
    """The admin API answers the admin key only."""
    if not who.admin:
        raise OpenAIError(403, "the admin API needs the admin key", type="permission_error",
                          code="admin_key_required")
