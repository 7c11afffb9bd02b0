"""EngineProxy.Multiplex: many Generate / GenerateOnce calls over one long-lived stream (the gateway's
hot path; see the proto). Each call runs in a task of its own, through the servicer's own Generate or
GenerateOnce with a context that stands in for a call's (its deadline, and an abort that becomes the
call's MultiplexError), so routing, failover, the media guard, errors and metrics are the same code.

A cancel message, or the end of the stream, cancels the calls still running (the engine's request
is closed, as when a Generate call is cancelled). When the caller closes its side, the calls already
started finish before the stream ends. Each call gets the SERVER span a Generate call gets (Guard
does not trace the stream itself: one span as long as a stream would hide the calls)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from opentelemetry import trace

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.svc import PARAM_KEY, REASON_KEY, server_span, tracing_enabled

log = logging.getLogger(__name__)

_SERVICE = "examlops.engine_proxy.v1.EngineProxy"
#: The reason a draining engine-proxy refuses a new call on an open stream with.
DRAINING = "draining"


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, trailing: dict[str, str]) -> None:
        super().__init__(message)
        self.error = pb.MultiplexError(code=code.value[0], message=message,
                                     reason=trailing.get(REASON_KEY, ""), param=trailing.get(PARAM_KEY, ""))


class CallContext:
    """What Generate and GenerateOnce ask of their context, for a call on a Multiplex stream."""

    __slots__ = ("deadline", "status", "trailing")

    def __init__(self, timeout_ms: int) -> None:
        self.deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None
        self.trailing: dict[str, str] = {}
        self.status: grpc.StatusCode | None = None

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        self.trailing = dict(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.status = code
        raise _Aborted(code, details, self.trailing)


def _error(code: grpc.StatusCode, message: str) -> pb.MultiplexError:
    return pb.MultiplexError(code=code.value[0], message=message)


class Multiplex:
    """One Multiplex stream's calls: started as their requests arrive, answered in one queue."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self.out: asyncio.Queue[pb.MultiplexReply | None] = asyncio.Queue()
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.reading = True
        self.tracer = trace.get_tracer("examlops.svc.grpc") if tracing_enabled() else None

    async def replies(self, requests: AsyncIterator[pb.MultiplexRequest]) -> AsyncIterator[pb.MultiplexReply]:
        reader = asyncio.create_task(self.read(requests))
        self.servicer.streams.add(self)
        if self.servicer.draining:
            self.drain()
        try:
            while True:
                reply = await self.out.get()
                if reply is None:  # the reader ended, a call did, or a drain began: is the stream done?
                    if not self.reading and not self.calls:
                        break
                    continue
                yield reply
        finally:
            self.servicer.streams.discard(self)
            reader.cancel()
            for task in list(self.calls.values()):
                task.cancel()

    def drain(self) -> None:
        """No new call (each is refused UNAVAILABLE, reason `draining`: the caller sends it again on a
        new stream); the stream ends once the open calls are answered."""
        self.reading = False
        self.out.put_nowait(None)

    async def read(self, requests: AsyncIterator[pb.MultiplexRequest]) -> None:
        try:
            async for message in requests:
                task = self.calls.get(message.id)
                if message.cancel:
                    if task is not None:
                        task.cancel()
                elif task is None and self.servicer.draining:
                    self.out.put_nowait(pb.MultiplexReply(id=message.id, error=pb.MultiplexError(
                        code=grpc.StatusCode.UNAVAILABLE.value[0], reason=DRAINING,
                        message="engine-proxy is shutting down; send the call on a new stream")))
                elif task is None:
                    self.calls[message.id] = asyncio.create_task(self.run(message))
                else:  # a caller's bug; the running call keeps its id
                    self.out.put_nowait(pb.MultiplexReply(id=message.id, error=_error(
                        grpc.StatusCode.INVALID_ARGUMENT, f"call id {message.id} is already open on this stream")))
        except grpc.aio.AioRpcError:
            pass  # the caller's side broke: replies() is cancelled with the stream
        finally:
            if not self.servicer.draining:  # a draining stream still answers the calls it refuses
                self.reading = False
                self.out.put_nowait(None)

    async def run(self, message: pb.MultiplexRequest) -> None:
        context = CallContext(message.timeout_ms)
        call = message.id
        try:
            with self.span(message, context):
                async with asyncio.timeout(context.time_remaining()):
                    if message.once:
                        chunk = await self.servicer.GenerateOnce(message.request, context)
                        self.out.put_nowait(pb.MultiplexReply(id=call, chunk=chunk, end=True))
                        return
                    ended = False  # the final chunk ends the answer: its message says so (one message less)
                    async with contextlib.aclosing(self.servicer.Generate(message.request, context)) as chunks:
                        async for chunk in chunks:
                            ended = chunk.final
                            self.out.put_nowait(pb.MultiplexReply(id=call, chunk=chunk, end=ended))
                    if not ended:
                        self.out.put_nowait(pb.MultiplexReply(id=call, end=True))
        except _Aborted as exc:
            self.out.put_nowait(pb.MultiplexReply(id=call, error=exc.error))
        except TimeoutError:
            context.status = grpc.StatusCode.DEADLINE_EXCEEDED
            self.out.put_nowait(pb.MultiplexReply(id=call, error=_error(context.status, "Deadline Exceeded")))
        except Exception:
            log.exception("multiplexed call %d (%s) failed", call, message.request.endpoint)
            context.status = grpc.StatusCode.UNKNOWN
            failed = _error(context.status, "engine-proxy failed the call")
            self.out.put_nowait(pb.MultiplexReply(id=call, error=failed))
        finally:
            self.calls.pop(call, None)
            if not self.reading and not self.calls:
                self.out.put_nowait(None)

    def span(self, message: pb.MultiplexRequest, context: CallContext) -> Any:
        """The SERVER span Guard gives a Generate or GenerateOnce call, child of the caller's context."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return _CallSpan(self.tracer, message, context)


#: A call's status by how its task ended (an abort sets its own).
_STATUS_OF: dict[Any, grpc.StatusCode] = {None: grpc.StatusCode.OK, asyncio.CancelledError: grpc.StatusCode.CANCELLED,
                                          TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED}


class _CallSpan:
    __slots__ = ("context", "message", "scope", "tracer")

    def __init__(self, tracer: trace.Tracer, message: pb.MultiplexRequest, context: CallContext) -> None:
        self.tracer, self.message, self.context = tracer, message, context

    def __enter__(self) -> None:
        rpc = "GenerateOnce" if self.message.once else "Generate"
        self.scope = server_span(self.tracer, f"/{_SERVICE}/{rpc}", dict(self.message.trace))
        self.scope.__enter__()

    def __exit__(self, *exc: Any) -> None:
        status = self.context.status or _STATUS_OF.get(exc[0], grpc.StatusCode.UNKNOWN)
        trace.get_current_span().set_attribute("rpc.grpc.status_code", status.value[0])
        self.scope.__exit__(*exc)

