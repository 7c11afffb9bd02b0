"""An SSE response written straight from its generator, each item in one write.

Starlette's StreamingResponse (on uvicorn's ASGI 2.3) runs every stream in an anyio task group
with a second task listening for the client's disconnect. This one streams in the request's own
task and has one plain asyncio task wait for `http.disconnect`: a client that leaves mid-stream
cancels the stream, and the generator is closed before the response returns (its `finally` settles
what was sent), whether the cancel landed in the generator or in a write the client's flow control
held back. The generator's last item, DONE, goes in the same write as the end of the body. A
client that reads nothing for `write_timeout_s` (a write held back by its flow control that long)
is treated as gone too: the stream ends there, the connection is closed, nothing waits on it.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

#: the stream's last event; the response ends the body with it
DONE = b"data: [DONE]\n\n"

log = logging.getLogger(__name__)


class _Stalled(Exception):
    """A write waited on the client's flow control longer than the stream allows."""


class LeanStream(StreamingResponse):
    finished = False   # the body's end is being sent: a disconnect now is the normal end
    client_gone = False
    write_timeout_s: float | None = None  # a write the client's flow control holds back longer ends the stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.current_task()
        assert stream is not None
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, stream))
        try:
            await self.stream_response(send if self.write_timeout_s is None else self._bounded(send))
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            stream.uncancel()  # our own cancel, for the client that left: the request ends normally
        except _Stalled:  # the server closes the connection: the response never completed
            self.client_gone = True
            log.warning("a client read nothing of its stream for %g s: stream ended, connection closed",
                        self.write_timeout_s)
        finally:
            watcher.cancel()
            if (close := getattr(self.body_iterator, "aclose", None)) is not None:
                await close()  # a generator left at a yield (a write was cancelled) ends now

    def _bounded(self, send: Send) -> Send:
        timeout_s = self.write_timeout_s

        async def bounded(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None
        return bounded

    async def _watch(self, receive: Receive, stream: asyncio.Task[object]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.client_gone = True
            stream.cancel()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            last = chunk is DONE
            self.finished = last
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        if not self.finished:
            self.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
