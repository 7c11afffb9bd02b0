"""A real OTLP trace receiver for tests: what an OpenTelemetry Collector would get, decoded.

`OtlpReceiver("http/protobuf")` listens on 127.0.0.1 for `POST /v1/traces` (protobuf, optionally
gzip); `OtlpReceiver("grpc")` serves `opentelemetry.proto.collector.trace.v1.TraceService/Export`.
Both decode `ExportTraceServiceRequest` with the official `opentelemetry-proto` classes and keep
each span as a plain `ReceivedSpan` (ids in hex, attributes as Python values, the service.name of
its resource). `receiver.env()` is the set of OTEL_* variables that points an SDK at it.

    with OtlpReceiver() as otlp:
        start_services(extra_env=otlp.env())
        ...
        spans = otlp.wait_for(lambda s: any(x.name == "chat" for x in s))
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER" or "UNSPECIFIED"
    status: str  # "UNSET", "OK" or "ERROR"
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str  # the instrumentation scope (tracer) name
    start_ns: int
    end_ns: int
    events: list[dict[str, Any]] = field(default_factory=list)


def plain_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as the Python value an SDK was given."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [plain_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return plain_attributes(value.kvlist_value.values)
    return getattr(value, which)


def plain_attributes(pairs: Any) -> dict[str, Any]:
    kv: list[KeyValue] = list(pairs)
    return {p.key: plain_value(p.value) for p in kv}


def decode_export(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """The spans of one export, each with its resource's service.name."""
    out: list[ReceivedSpan] = []
    for rs in request.resource_spans:
        resource = plain_attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    service=str(resource.get("service.name", "")),
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), name=s.name,
                    kind=Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                    status=Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                    status_message=s.status.message, attributes=plain_attributes(s.attributes),
                    resource=resource, scope=ss.scope.name,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    events=[{"name": e.name, "attributes": plain_attributes(e.attributes)}
                            for e in s.events]))
    return out


class OtlpReceiver:
    """An OTLP/HTTP (protobuf) or OTLP/gRPC trace receiver on 127.0.0.1:`port` (0: a free port)."""

    def __init__(self, protocol: str = "http/protobuf", *, port: int = 0) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        self.protocol = protocol
        self._port = port
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.exports = 0  # export requests received (a batch each)
        self.headers: list[dict[str, str]] = []  # each export's HTTP headers / gRPC metadata
        self._httpd: ThreadingHTTPServer | None = None
        self._grpc: grpc.Server | None = None
        self.port = 0

    # -- life --------------------------------------------------------------------------------
    def start(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_GrpcTraceService(self), self._grpc)
            self.port = self._grpc.add_insecure_port(f"127.0.0.1:{self._port}")
            self._grpc.start()
        else:
            self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _http_handler(self))
            self.port = self._httpd.server_address[1]
            threading.Thread(target=self._httpd.serve_forever, name="otlp-receiver", daemon=True).start()
        return self

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- where SDKs send to ----------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The base URL for OTEL_EXPORTER_OTLP_ENDPOINT (the HTTP exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The OTEL_* variables that make a service export here (batching kept short for tests)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol,
                "OTEL_BSP_SCHEDULE_DELAY": "200", **extra}

    # -- what arrived ----------------------------------------------------------------------------
    def record(self, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        spans = decode_export(request)
        with self._cond:
            self.exports += 1
            self.headers.append(headers)
            self._spans.extend(spans)
            self._cond.notify_all()

    def spans(self, name: str | None = None, *, service: str | None = None,
              trace_id: str | None = None) -> list[ReceivedSpan]:
        """The spans received so far (in arrival order), optionally only those matching."""
        with self._cond:
            return [s for s in self._spans if (name is None or s.name == name)
                    and (service is None or s.service == service)
                    and (trace_id is None or s.trace_id == trace_id)]

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool],
                 timeout: float = 15.0) -> list[ReceivedSpan]:
        """Block until `predicate(all spans)` holds, and return the spans; TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise TimeoutError(f"OTLP receiver: condition not met in {timeout}s; "
                                       f"{len(self._spans)} spans received: {names}")
                self._cond.wait(left)
            return list(self._spans)

    def wait_for_span(self, name: str, *, service: str | None = None, timeout: float = 15.0) -> ReceivedSpan:
        """The first span called `name` (of `service`), waiting for it to arrive."""
        self.wait_for(lambda _: bool(self.spans(name, service=service)), timeout)
        return self.spans(name, service=service)[0]

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self.headers.clear()
            self.exports = 0


def _http_handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.split("?")[0] != "/v1/traces":
                return self._answer(404, b"")
            if self.headers.get("Content-Encoding") == "gzip":
                data = gzip.decompress(data)
            request = trace_service_pb2.ExportTraceServiceRequest()
            try:
                request.ParseFromString(data)
            except Exception:  # a malformed body is the sender's fault: say so, as a collector would
                return self._answer(400, b"")
            receiver.record(request, {k.lower(): v for k, v in self.headers.items()})
            self._answer(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self.receiver.record(request, {k: str(v) for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()
