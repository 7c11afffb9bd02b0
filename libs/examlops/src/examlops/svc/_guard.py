"""What every gRPC server does around each call: metrics, caller authentication and, when tracing is
on, a SERVER span.

Each method handler is wrapped once, when it is registered (build_grpc_server hands register() a
GuardedServer), rather than by grpc.aio server interceptors: grpc runs interceptors as a chain of
coroutines that builds a new handler on every call, a cost measurable on engine-proxy's hot path.
Per call, outermost first:

- a SERVER span when tracing is on (not for health checks or reflection), child of the caller's
  `traceparent`, current while the handler runs, with the call's status code;
- metrics: a unary call is timed and counted with its code (OK or ERROR) when its handler returns,
  a streaming call is counted STARTED when it starts; refused calls are counted too;
- authentication (ServerAuth.check; health and reflection are open): a refused call ends with its
  code and reason before the handler runs; an admitted caller is current_caller() in the handler.

A method no handler serves is counted STARTED as method `unknown`, then grpc answers UNIMPLEMENTED.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from opentelemetry import propagate, trace
from prometheus_client import Counter, Histogram

from ._auth import ServerAuth, open_method

RPC_SECONDS = Histogram(
    "examlops_grpc_server_handling_seconds", "Time to handle a gRPC call (until the handler returns).",
    ["method"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
RPC_TOTAL = Counter("examlops_grpc_server_handled_total", "gRPC calls handled.", ["method", "code"])
UNKNOWN_METHODS = RPC_TOTAL.labels("unknown", "STARTED")

#: Calls that get no span: probes and reflection would bury the traces of real work; engine-proxy's
#: Multiplex carries many calls, each of which gets a span of its own there (one span as long as the
#: stream would hide them).
UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/examlops.engine_proxy.v1.EngineProxy/Multiplex")

Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


class _Counts:
    """One method's metric series, each looked up once (labels() takes a lock on every call)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.codes: dict[str, Any] = {}
        self.seconds: Any = None

    def inc(self, code: str) -> None:
        child = self.codes.get(code)
        if child is None:
            child = self.codes[code] = RPC_TOTAL.labels(self.method, code)
        child.inc()

    def observe(self, seconds: float) -> None:
        if self.seconds is None:
            self.seconds = RPC_SECONDS.labels(self.method)
        self.seconds.observe(seconds)


class Guard:
    """Wraps the method handlers of one server with its metrics, authentication and tracing."""

    def __init__(self, auth: ServerAuth, tracer: trace.Tracer | None) -> None:
        self.auth = auth
        self.tracer = tracer

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` of `method` (/package.Service/Rpc) with the checks above; same shape and codecs."""
        counts = _Counts(method)
        auth = None if open_method(method) else self.auth
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            inner = handler.stream_stream if handler.request_streaming else handler.unary_stream
            call = _streaming(inner, counts, auth)
        else:
            make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                    else grpc.unary_unary_rpc_method_handler)
            inner = handler.stream_unary if handler.request_streaming else handler.unary_unary
            call = _unary(inner, counts, auth)
        if self.tracer is not None and not method.startswith(UNTRACED_PREFIXES):
            call = _traced(call, method, self.tracer, handler.response_streaming)
        return make(call, **kw)


def _unary(inner: Handler, counts: _Counts, auth: ServerAuth | None) -> Handler:
    method = counts.method

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            if auth is not None:
                refusal = auth.check(method, context.invocation_metadata())
                if refusal is not None:
                    await refusal.send(context)  # raises
            return await inner(request, context)
        except Exception:
            code = "ERROR"
            raise
        finally:
            counts.observe(time.perf_counter() - start)
            counts.inc(code)

    return call


def _streaming(inner: Handler, counts: _Counts, auth: ServerAuth | None) -> Handler:
    method = counts.method

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        counts.inc("STARTED")
        if auth is not None:
            refusal = auth.check(method, context.invocation_metadata())
            if refusal is not None:
                await refusal.send(context)  # raises
        result = inner(request, context)
        if not hasattr(result, "__aiter__"):  # a handler that writes with context.write()
            await result
            return
        async with contextlib.aclosing(result) as messages:
            async for message in messages:
                yield message

    return call


def server_span(tracer: trace.Tracer, method: str, carrier: dict[str, Any]) -> Any:
    """The SERVER span of a call of `method` (/package.Service/Rpc), child of the trace context in
    `carrier` (a call's metadata; a Multiplex call's trace field), current while it is open."""
    name = method.lstrip("/")
    service, _, rpc = name.rpartition("/")
    return tracer.start_as_current_span(name, context=propagate.extract(carrier), kind=trace.SpanKind.SERVER,
                                        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc})


def _traced(call: Handler, method: str, tracer: trace.Tracer, streaming: bool) -> Handler:
    def span(context: grpc.aio.ServicerContext) -> Any:
        return server_span(tracer, method, dict(context.invocation_metadata() or ()))

    def ended(s: trace.Span, context: grpc.aio.ServicerContext) -> None:
        code = context.code()
        if code is not None:
            s.set_attribute("rpc.grpc.status_code", code.value[0] if isinstance(code, grpc.StatusCode) else code)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with span(context) as s:
            try:
                return await call(request, context)
            finally:
                ended(s, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with span(context) as s:
            try:
                async with contextlib.aclosing(call(request, context)) as messages:
                    async for message in messages:
                        yield message
            finally:
                ended(s, context)

    return stream if streaming else unary


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers are guarded (each method's wrapper made once)."""

    def __init__(self, inner: grpc.GenericRpcHandler, guard: Guard) -> None:
        self.inner = inner
        self.guard = guard
        self.wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.inner.service(details)
        if handler is None:
            return None
        method: str = details.method
        seen = self.wrapped.get(method)
        if seen is None or seen[0] is not handler:
            seen = self.wrapped[method] = (handler, self.guard.wrap(method, handler))
        return seen[1]


class _CountUnknown(grpc.GenericRpcHandler):
    """Last in line: a method nothing serves is counted STARTED under one label, `unknown` (the name
    is the caller's to choose: one series each would let any caller grow /metrics without bound);
    grpc then answers UNIMPLEMENTED."""

    def service(self, details: grpc.HandlerCallDetails) -> None:
        UNKNOWN_METHODS.inc()
        return None


class GuardedServer(grpc.aio.Server):
    """The server as register() sees it: every handler added through it is guarded; the rest is the
    real server's."""

    def __init__(self, server: grpc.aio.Server, guard: Guard) -> None:
        self.server = server
        self.guard = guard

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers([_GuardedGeneric(h, self.guard) for h in generic_rpc_handlers])

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.server.add_registered_method_handlers(service_name, {
            name: self.guard.wrap(f"/{service_name}/{name}", handler) for name, handler in method_handlers.items()})

    def count_unknown_methods(self) -> None:
        """Call after every service is added."""
        self.server.add_generic_rpc_handlers([_CountUnknown()])

    def add_insecure_port(self, address: str) -> int:
        return int(self.server.add_insecure_port(address))

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return int(self.server.add_secure_port(address, server_credentials))

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return bool(await self.server.wait_for_termination(timeout))
