"""Request checks shared by the registry's servicers."""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import TypeVar

import grpc

from examlops.svc import abort

R = TypeVar("R")


async def refuse_first(context: grpc.aio.ServicerContext, reason: str,
                       problems: Iterable[tuple[str, bool, str]]) -> None:
    """End the call INVALID_ARGUMENT on the first (field, is_bad, message) that is bad."""
    for field, bad, message in problems:
        if bad:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, reason, message, field)


class Refused(Exception):
    """A request the registry will not carry out: the status code, the reason, the field."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.field = code, reason, field


async def answer(context: grpc.aio.ServicerContext, work: Awaitable[R]) -> R:
    """The result of `work`, or the call ended with the Refused it raised."""
    try:
        return await work
    except Refused as exc:
        await abort(context, exc.code, exc.reason, str(exc), exc.field)


def few(items: Iterable[str], limit: int = 20) -> str:
    """Up to `limit` names, sorted, and how many more; "none" for none."""
    found = sorted(items)
    return ", ".join(found[:limit]) + (f" and {len(found) - limit} more" if len(found) > limit else "") or "none"
