"""The judges' `Ask`: a chat request to a route through engine-proxy, like a client's but with no
key and no budget. Each judge call is recorded in the admin key's cost stream (status 200 or the
error's, `guarded` = `judge`), so `exa gateway spend --by key` shows what judging costs."""

from __future__ import annotations

import time
from typing import Any

import grpc

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ..governance import Governor
from ._judge import Ask


def engine_proxy_ask(engine_proxy: Any, governor: Governor) -> Ask:
    async def ask(route: str, body: bytes, timeout_s: float) -> bytes:
        started = time.perf_counter()
        ticket = governor.admin_ticket(route, body, started, guarded="judge")
        request = pb.GenerateRequest(endpoint=route, kind=pb.REQUEST_KIND_CHAT, body_json=body)
        try:
            chunk = await engine_proxy.GenerateOnce(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # an unknown route is no call
                ticket.settle_later("504" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "502")
            raise
        if not chunk.data:
            ticket.settle_later("502")
            raise RuntimeError(f"the judge route {route!r} answered nothing")
        ticket.settle_later("200", chunk.usage if chunk.HasField("usage") else None, None)
        return bytes(chunk.data)
    return ask
