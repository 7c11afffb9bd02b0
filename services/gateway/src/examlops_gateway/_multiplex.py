"""engine-proxy's Multiplex from the gateway's side: its Generate and GenerateOnce calls multiplexed on
one long-lived stream (see the proto; a call's setup costs about 0.2 ms of a core at each end, a
message on an open stream a fraction of that).

A call is an object with the part of a grpc.aio call the gateway uses: `read()` (the next chunk, or
grpc.aio.EOF after the last), `await call` (GenerateOnce's answer) and `cancel()`. A failed call
raises grpc.aio.AioRpcError with the code, message, reason and param the unary or streaming call
would have ended with, so the error paths are the same. Its request is written on the first read.

The gateway also enforces each call's deadline (engine-proxy does first; this covers one that never
answers). A stream takes new calls for ROTATE_S; the next call after that opens a new stream and the
old one is closed on our side once its calls are answered: engine-proxy ends each connection after a
minute (max_connection_age, so a scale-out gets calls) and cuts a stream still open after its grace.
When the stream breaks (engine-proxy restarted), its open calls fail UNAVAILABLE, as calls on a
broken channel do, and the next call opens a new stream."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Generator
from typing import Any

import grpc
from opentelemetry import propagate

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.svc import PARAM_KEY, REASON_KEY, tracing_enabled

MULTIPLEX_METHOD = "/examlops.engine_proxy.v1.EngineProxy/Multiplex"
ROTATE_S = 30.0
#: Beyond a call's deadline, how long the gateway waits for engine-proxy's own DEADLINE_EXCEEDED.
DEADLINE_GRACE_S = 1.0
_NO_METADATA = grpc.aio.Metadata()
#: The reason engine-proxy refuses a new call on a stream with while it shuts down.
DRAINING = "draining"


def _rpc_error(code: grpc.StatusCode, message: str, reason: str = "", param: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((REASON_KEY, reason), (PARAM_KEY, param)) if reason or param else _NO_METADATA
    return grpc.aio.AioRpcError(code, _NO_METADATA, trailing, details=message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class EngineMultiplex:
    """The gateway's Multiplex streams to one engine-proxy channel (one open for new calls)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.open_stream = channel.stream_stream(MULTIPLEX_METHOD,
                                                 request_serializer=pb.MultiplexRequest.SerializeToString,
                                                 response_deserializer=pb.MultiplexReply.FromString)
        self.current: _Stream | None = None
        self.ids = itertools.count(1)
        self.streams: set[_Stream] = set()

    def call(self, request: pb.GenerateRequest, *, once: bool, timeout: float) -> MultiplexCall:
        """A Generate (once=False) or GenerateOnce call; with tracing on, it carries the current span's context."""
        message = pb.MultiplexRequest(id=next(self.ids), request=request, once=once, timeout_ms=int(timeout * 1000))
        if tracing_enabled():
            propagate.inject(message.trace)
        return MultiplexCall(self.stream(), message, time.monotonic() + timeout + DEADLINE_GRACE_S)

    def stream(self) -> _Stream:
        """The stream new calls go on: the current one, or a new one once it is old, retired or broken."""
        stream, now = self.current, time.monotonic()
        if stream is None or stream.broken is not None or stream.retired or now - stream.opened > ROTATE_S:
            if stream is not None:
                stream.retire()
            stream = self.current = _Stream(self, now)
        return stream

    def close(self) -> None:
        for stream in list(self.streams):
            stream.call.cancel()


class _Stream:
    """One Multiplex stream: its writes (one at a time) and its reader, which hands each reply to its call."""

    def __init__(self, owner: EngineMultiplex, opened: float) -> None:
        self.owner, self.opened, self.streams = owner, opened, owner.streams
        self.call = owner.open_stream(None)
        self.waiting: dict[int, MultiplexCall] = {}
        self.broken: grpc.aio.AioRpcError | None = None
        self.retired = self.closing = False
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.streams.add(self)
        self.reader = asyncio.get_running_loop().create_task(self.read())

    async def send(self, message: pb.MultiplexRequest, call: MultiplexCall | None = None) -> None:
        """Write `message`. One that cannot be written never reached engine-proxy: `call` (the call
        it starts) goes on a new stream, once, or fails; the reader ends the calls already sent."""
        try:
            async with self.lock:
                await self.call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            self.retired = True
            if call is not None and call.stream is self and not call.resend():  # (not one resent meanwhile)
                call.fail(exc if isinstance(exc, grpc.aio.AioRpcError) else
                          self.broken or _rpc_error(grpc.StatusCode.UNAVAILABLE, "engine-proxy's stream ended"))

    def background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "engine-proxy ended the stream")
        clean = False
        try:
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    clean = True  # engine-proxy ends a stream once no call is open on it
                    break
                waiting = self.waiting.get(reply.id)
                if waiting is not None:
                    waiting.deliver(reply)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
        finally:
            self.retired = True
            if clean:  # what is still waiting was never started: it goes on a new stream
                for waiting in list(self.waiting.values()):
                    waiting.resend()
            self.failed(error)
            self.streams.discard(self)

    def failed(self, error: grpc.aio.AioRpcError) -> None:
        """The stream is done: its open calls end with `error`."""
        if self.broken is None:
            self.broken = error
        for waiting in list(self.waiting.values()):
            waiting.fail(self.broken)

    def done(self, call_id: int) -> None:
        self.waiting.pop(call_id, None)
        if self.retired and not self.waiting and self.broken is None:
            self.background(self.close_writing())

    def retire(self) -> None:
        """No new calls: close our side once the open ones are answered (engine-proxy then ends it)."""
        self.retired = True
        if not self.waiting and self.broken is None:
            self.background(self.close_writing())

    async def close_writing(self) -> None:
        if self.closing:
            return
        self.closing = True
        async with self.lock:  # after the writes already queued (a cancel, say)
            if self.broken is None and not self.call.done():
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    await self.call.done_writing()


class MultiplexCall:
    """One call on a Multiplex stream, read like a grpc.aio call."""

    __slots__ = ("chunks", "ended", "error", "message", "resent", "sent", "stream", "timer", "waiter")

    def __init__(self, stream: _Stream, message: pb.MultiplexRequest, deadline: float) -> None:
        self.stream, self.message = stream, message
        self.chunks: deque[pb.GenerateChunk] = deque()
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = self.sent = self.resent = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        if stream.broken is not None:
            self.error, self.ended = stream.broken, True
        else:
            stream.waiting[message.id] = self
            self.timer = loop.call_at(loop.time() + deadline - time.monotonic(), self.expire)

    def deliver(self, reply: pb.MultiplexReply) -> None:
        if reply.HasField("chunk"):
            self.chunks.append(reply.chunk)
        if reply.HasField("error"):
            e = reply.error
            if e.reason == DRAINING and self.resend():
                return
            self.fail(_rpc_error(_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.message, e.reason, e.param))
        elif reply.end:
            self.finish()
        self.wake()

    def resend(self) -> bool:
        """Send the call again on a new stream: engine-proxy refused it (draining) or ended the stream
        before reading it, so it never started. Once; False when it cannot be sent again."""
        if self.resent or self.chunks or self.ended or not self.sent:
            return False
        self.resent = True
        old = self.stream
        old.retired = True  # it takes no new call
        old.done(self.message.id)
        self.stream = new = old.owner.stream()
        new.waiting[self.message.id] = self
        new.background(new.send(self.message, self))
        return True

    def finish(self) -> None:
        if not self.ended:
            self.ended = True
            if self.timer is not None:
                self.timer.cancel()
            self.stream.done(self.message.id)

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self.error is None and not self.ended:
            self.error = error
        self.finish()
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def expire(self) -> None:
        self.tell_engine_proxy()  # before the stream may be closed for want of calls
        self.fail(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    async def read(self) -> Any:
        """The next chunk; grpc.aio.EOF after the last; raises the call's error after its chunks."""
        if not self.sent:
            self.sent = True
            if not self.ended:
                await self.stream.send(self.message, self)
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.ended:
                return grpc.aio.EOF
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.chunks.popleft()

    def __await__(self) -> Generator[Any, None, pb.GenerateChunk]:
        answer = yield from self.read().__await__()
        return pb.GenerateChunk() if answer is grpc.aio.EOF else answer

    def cancel(self) -> bool:
        """Stop the call (engine-proxy stops the engine's work); False once it had ended."""
        if self.ended:
            return False
        self.tell_engine_proxy()  # before the stream may be closed for want of calls
        self.fail(_rpc_error(grpc.StatusCode.CANCELLED, "the call was cancelled"))
        return True

    def tell_engine_proxy(self) -> None:
        if self.sent and self.stream.broken is None:
            self.stream.background(self.stream.send(pb.MultiplexRequest(id=self.message.id, cancel=True)))
