"""An SSE response written straight from its generator, each item in one write.

Starlette's StreamingResponse (on uvicorn's ASGI 2.3) runs every stream in an anyio task group
with a second task listening for the client's disconnect. This one streams in the request's own
task and has one plain asyncio task wait for `http.disconnect`: a client that leaves mid-stream
cancels the stream, and the generator is closed before the response returns (its `finally` settles
what was sent), whether the cancel landed in the generator or in a write the client's flow control
held back. The generator's last item, DONE, goes in the same write as the end of the body.
"""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

#: the stream's last event; the response ends the body with it
DONE = b"data: [DONE]\n\n"


class LeanStream(StreamingResponse):
    finished = False   # the body's end is being sent: a disconnect now is the normal end
    client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.current_task()
        assert stream is not None
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, stream))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            stream.uncancel()  # our own cancel, for the client that left: the request ends normally
        finally:
            watcher.cancel()
            if (close := getattr(self.body_iterator, "aclose", None)) is not None:
                await close()  # a generator left at a yield (a write was cancelled) ends now

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
