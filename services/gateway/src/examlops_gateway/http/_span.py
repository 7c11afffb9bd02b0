"""The generation span: one CLIENT span per engine call, named `{operation} {model}`, with the
OpenTelemetry GenAI semantic conventions' attributes and ours (services/gateway/TRACING.md).

It starts around engine-proxy's call (GenerateOnce or Generate), whose gRPC span (and vLLM's) are its children, and
ends when the call is settled, however the answer ended (whole, streamed to its end, cut short, the
client gone), stamped with the time the answer ended, so its cost (the settled cost record's) and
the engine's token counts are on it. Only the OpenTelemetry API is used: with no SDK provider
installed the span does not record and nothing below builds an attribute (`recording` is checked
first), so tracing off costs one no-op span per call.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.registry.v1.registry_pb2 import Endpoint

from ..governance import Ticket, Usage

tracer = trace.get_tracer("examlops.gateway")

#: gen_ai.operation.name by request kind
OPERATIONS: dict[int, str] = {pb.REQUEST_KIND_CHAT: "chat", pb.REQUEST_KIND_COMPLETION: "text_completion",
              pb.REQUEST_KIND_EMBEDDINGS: "embeddings"}
#: gen_ai.provider.name by engine: the software that serves the model (no well-known value fits)
PROVIDERS = {"vllm-server": "vllm", "vllm-inproc": "vllm"}
#: what error.type says when the client left before the answer ended
CLIENT_GONE = "client_gone"

# JSON from the engine escapes every quote inside a string, so these match keys only.
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]*)"')


class GenerationSpan:
    """The span of one engine call, fed as the answer comes back."""

    __slots__ = ("ended_ns", "finish_reasons", "recording", "span")

    def __init__(self, kind: int, ticket: Ticket, ep: Endpoint | None, req: Any = None) -> None:
        operation = OPERATIONS.get(kind, "chat")
        self.span = tracer.start_span(f"{operation} {ticket.model}", kind=SpanKind.CLIENT)
        self.recording = self.span.is_recording()
        self.finish_reasons: list[str] = []
        self.ended_ns = 0
        if self.recording:
            self.span.set_attributes(_request_attributes(operation, ticket, ep, req))

    @contextmanager
    def active(self) -> Iterator[None]:
        """The span as the current one (the engine-proxy call made inside is its child)."""
        if not self.recording:
            yield
            return
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def answered(self, first: pb.GenerateChunk, ep: Endpoint | None) -> None:
        """The first message: the replica that answers, and what the message says."""
        if not self.recording:
            return
        span = self.span
        span.set_attribute("examlops.replica", first.replica)
        replica = next((r for r in ep.replicas if r.id == first.replica), None) if ep is not None else None
        url = urlsplit(replica.base_url if replica is not None else (ep.base_url if ep is not None else ""))
        if url.hostname:
            span.set_attribute("server.address", url.hostname)
            if url.port:
                span.set_attribute("server.port", url.port)
        if (found := _MODEL.search(first.sse or first.data)) is not None:
            span.set_attribute("gen_ai.response.model", found.group(1).decode(errors="replace"))
        self.saw(first)

    def saw(self, chunk: pb.GenerateChunk) -> None:
        """A message of the answer: its choices' finish reasons, the final message's SpecDecode."""
        if not self.recording:
            return
        chunks = chunk.sse or chunk.data  # one chunk's JSON or several SSE frames: the pattern finds each
        if chunks:
            self.finish_reasons.extend(m.decode(errors="replace") for m in _FINISH.findall(chunks))
        if chunk.HasField("spec_decode"):
            spec = chunk.spec_decode
            self.span.set_attributes({"examlops.specdecode.acceptance_rate": spec.acceptance_rate,
                                      "examlops.specdecode.speedup": spec.speedup})

    def from_cache(self, ticket: Ticket, answer: dict[str, Any]) -> None:
        """A cache hit answered the call: the stored answer's model and finish reasons; no engine
        ran, so no usage, and the hit costs nothing (its cost record bills 0 tokens). Ends the span."""
        if self.recording:
            self.span.set_attribute("gen_ai.response.model", str(answer.get("model") or ""))
            self.finish_reasons = [str(c.get("finish_reason")) for c in answer.get("choices") or ()
                                   if isinstance(c, dict) and c.get("finish_reason")]
            self.span.set_attribute("examlops.cost.usd", ticket.cost_usd or 0.0)
        self.ended_ns = time.time_ns()
        self.end(ticket, None)

    def failed(self, code: str | None, message: str) -> None:
        """The call ended in error: status ERROR, error.type the OpenAI error code."""
        if not self.recording:
            return
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.set_attribute("error.type", code or "error")

    async def settle(self, ticket: Ticket, status: str, usage: Usage | None = None, delivered: int | None = 0) -> None:
        """ticket.settle, then the span ends."""
        self.ended_ns = time.time_ns()
        try:
            await ticket.settle(status, usage, delivered)
        finally:
            self.end(ticket, usage)

    def settle_later(self, ticket: Ticket, status: str, usage: Usage | None = None,
                     delivered: int | None = 0) -> asyncio.Task[None] | None:
        """ticket.settle_later; the span ends when the settle is done (stamped now)."""
        self.ended_ns = time.time_ns()
        task = ticket.settle_later(status, usage, delivered)
        if task is None or not self.recording:
            self.end(ticket, usage)
        else:
            task.add_done_callback(lambda _: self.end(ticket, usage))
        return task

    def end(self, ticket: Ticket, usage: Usage | None) -> None:
        """The settled call's attributes (its engine usage, cost, TTFT, cache and guardrails), then the end."""
        if self.recording:
            self.span.set_attributes(_settled_attributes(ticket, usage, self.finish_reasons))
        self.span.end(end_time=self.ended_ns or None)


def _request_attributes(operation: str, ticket: Ticket, ep: Endpoint | None, req: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDERS.get(ep.engine, ep.engine) if ep is not None else "unknown",
        "gen_ai.request.model": ticket.model,
        "examlops.endpoint": ticket.model,
        "examlops.project": ticket.project,
        "examlops.virtual_key.id": ticket.caller.key_id,
    }
    max_tokens = ticket.max_tokens or getattr(req, "output_limit", 0)
    if max_tokens:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    temperature = getattr(req, "temperature", None)
    if temperature is not None:
        attributes["gen_ai.request.temperature"] = float(temperature)
    return attributes


def _settled_attributes(ticket: Ticket, usage: Usage | None, finish_reasons: list[str]) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "examlops.ttft_ms": round(ticket.ttft_s * 1000, 2),
        "examlops.cache": ticket.cache,
        "examlops.guardrails": ticket.guarded,
    }
    if ticket.cost_usd is not None:  # the cost record's cost (the cost provider's), set by the settle
        attributes["examlops.cost.usd"] = ticket.cost_usd
    if usage is not None:
        attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
    if finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = finish_reasons
    return attributes

