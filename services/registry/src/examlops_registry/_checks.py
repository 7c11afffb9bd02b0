"""Request checks shared by the registry's servicers."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from examlops.svc import abort


async def refuse_first(context: grpc.aio.ServicerContext, reason: str,
                       problems: Iterable[tuple[str, bool, str]]) -> None:
    """End the call INVALID_ARGUMENT on the first (field, is_bad, message) that is bad."""
    for field, bad, message in problems:
        if bad:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, reason, message, field)
