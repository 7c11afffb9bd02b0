"""Tracing: the OpenTelemetry SDK, configured only by OpenTelemetry's own variables.

With neither OTEL_EXPORTER_OTLP_TRACES_ENDPOINT nor OTEL_EXPORTER_OTLP_ENDPOINT set (or with
OTEL_SDK_DISABLED=true) nothing is installed: spans come from the API's no-op tracer, no interceptor
is added to channels or servers and no header is written, so tracing off costs nothing. With an
endpoint, a BatchSpanProcessor exports over OTLP (OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf, the
default, or grpc). The exporters read the endpoint, OTEL_EXPORTER_OTLP_HEADERS, timeouts and
compression themselves; the provider reads OTEL_TRACES_SAMPLER/_ARG, OTEL_RESOURCE_ATTRIBUTES and
OTEL_SERVICE_NAME (the service's own name when neither names one); the processor reads OTEL_BSP_*.

W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata and in the HTTP headers
engine-proxy sends to an engine, through OpenTelemetry's global propagator (OTEL_PROPAGATORS).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace

from examlops.urlmask import redact

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_PROTOCOL = "http/protobuf"  # the OTLP specification's default


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go, as the OTEL_* variables say; `endpoint` is "" when tracing is off."""

    endpoint: str
    protocol: str
    disabled: bool

    @property
    def on(self) -> bool:
        return bool(self.endpoint) and not self.disabled

    def describe(self) -> str:
        """One line for start-up output: whether spans are exported, and where."""
        if self.disabled:
            return "tracing off (OTEL_SDK_DISABLED=true)"
        if not self.endpoint:
            return "tracing off (set OTEL_EXPORTER_OTLP_ENDPOINT to export spans)"
        return f"tracing on: OTLP {self.protocol} to {redact(self.endpoint)}"  # a URL password never shows


def tracing_config(env: MutableMapping[str, str] | None = None) -> TracingConfig:
    """Read the OTEL_* variables (of `env`, default the process's); SystemExit on an unknown protocol."""
    env = os.environ if env is None else env
    endpoint = next((env[v].strip() for v in ENDPOINT_VARS if env.get(v, "").strip()), "")
    protocol = next((env[v].strip() for v in PROTOCOL_VARS if env.get(v, "").strip()), DEFAULT_PROTOCOL)
    if endpoint and protocol not in PROTOCOLS:
        var = next(v for v in PROTOCOL_VARS if env.get(v, "").strip())
        raise SystemExit(f"{var}={protocol!r}: the OTLP trace exporter speaks {' or '.join(PROTOCOLS)}")
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return TracingConfig(endpoint=endpoint, protocol=protocol, disabled=disabled)


_enabled = False


def tracing_enabled() -> bool:
    """True once `setup_tracing` installed an exporting SDK provider in this process."""
    return _enabled


def setup_tracing(service: str) -> bool:
    """Install the SDK tracer provider for `service` when an OTLP endpoint is set; True if it did.

    Call once per process at start-up, before channels and servers are built (they add the
    propagation interceptors only when tracing is on). Spans are flushed by `shutdown_tracing` or,
    failing that, at interpreter exit.
    """
    global _enabled
    config = tracing_config()
    if not config.on or _enabled:
        log.info("%s: %s", service, config.describe())
        return _enabled
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporter: SpanExporter
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        exporter = HttpExporter()
    # OTEL_SERVICE_NAME, then service.name in OTEL_RESOURCE_ATTRIBUTES, then the service's own name.
    named = "service.name" in OTELResourceDetector().detect().attributes
    resource = Resource.create({} if named else {"service.name": service})
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER / _ARG
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("%s: %s", service, config.describe())
    return True


def shutdown_tracing() -> None:
    """Export what is still batched and stop the exporter (a no-op when tracing is off)."""
    global _enabled
    if not _enabled:
        return
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
    _enabled = False


def with_trace_context(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus `traceparent` (and `tracestate`) of the current span, for an outgoing HTTP call;
    `headers` itself when tracing is off or no span is current."""
    if not _enabled:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {**headers, **carrier} if carrier else headers



#: Paths that get no span: probes and scrapes would bury the traces of real calls.
UNTRACED_PATHS = frozenset({"/metrics", "/healthz", "/livez", "/readyz"})


def fastapi_telemetry() -> dict[str, Any]:
    """`FastAPI(telemetry=...)`: FastAPI's native OpenTelemetry, reduced to what we want.

    With tracing on, a SERVER span per HTTP request ("POST /v1/chat/completions"), child of the
    client's `traceparent` when it sent one, current while the request is handled and ended once the
    response (a whole stream) is sent; no probe or scrape spans, no per-dependency spans, no OTel
    metrics or logs (Prometheus and the log stream carry those). With tracing off, none of it runs.
    """
    return {"tracing": _enabled, "operation_spans": False, "metrics": False, "logs": False,
            "auto_configure": False, "exclude": lambda scope: scope.get("path") in UNTRACED_PATHS}
