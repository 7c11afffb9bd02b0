"""The lean streaming response on a real uvicorn server: a client that leaves mid-stream closes the
stream's generator (its `finally` is what settles the call) before the response returns."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from examlops_gateway.http._streaming import LeanStream

CHUNK = b"data: " + b"x" * (1 << 20) + b"\n\n"  # far more than the socket buffers hold


class Seen:
    def __init__(self) -> None:
        self.yielded = 0
        self.closed = False
        self.closed_when_returned: bool | None = None
        self.returned = asyncio.Event()


def streaming_app(seen: Seen, write_timeout_s: float | None = None) -> Any:
    async def body() -> AsyncIterator[bytes]:
        try:
            while True:  # never awaits: a cancel can only land in the response's write
                seen.yielded += 1
                yield CHUNK
        finally:
            seen.closed = True

    class Probe(LeanStream):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:  # as the settled stream does: what it finds here is what it settles
                seen.closed_when_returned = seen.closed
                seen.returned.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            response = Probe(body(), media_type="text/event-stream")
            response.write_timeout_s = write_timeout_s
            await response(scope, receive, send)

    return app


@pytest.mark.asyncio
async def test_a_client_gone_while_a_write_waits_closes_the_stream_before_the_response_returns() -> None:
    await _client_stops_reading(Seen(), None, reset=True)


@pytest.mark.asyncio
async def test_a_client_that_reads_nothing_and_stays_has_its_stream_ended_after_the_write_timeout() -> None:
    await _client_stops_reading(Seen(), 0.5, reset=False)


async def _client_stops_reading(seen: Seen, write_timeout_s: float | None, reset: bool) -> None:
    """A client that reads nothing of an endless stream; it then resets, or just stays."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(streaming_app(seen, write_timeout_s), http="httptools", lifespan="off",
                                           log_level="critical"))
    serving = asyncio.get_running_loop().create_task(server.serve(sockets=[listener]))
    client = socket.socket()
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
        await asyncio.get_running_loop().sock_sendall(client, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        while seen.yielded < 2:  # seen only once a write waits: the client reads nothing
            await asyncio.sleep(0.01)
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # a reset, with the stream waiting to write
        await asyncio.wait_for(seen.returned.wait(), 30)
        assert seen.closed_when_returned is True
    finally:
        client.close()
        server.should_exit = True
        await serving
