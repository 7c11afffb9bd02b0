"""EngineProxy gRPC servicer: route → (media guard) → a replica of the endpoint's pool (failover
before the first chunk, _failover) → streamed back (Generate) or returned whole (GenerateOnce)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from prometheus_client import Counter

from examlops.engine import routing_of, task_of
from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as mg_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import RouteTable, abort, routable_replicas, state_name, unroutable_reason

from ._engines import Generation
from ._errors import EngineError, RouteNotFound, TaskMismatch
from ._failover import Attempts, generate_over
from ._media import guard_messages, has_media
from ._multiplex import Multiplex
from ._pool import EnginePool
from ._routing import affinity_key
from ._settings import EngineProxySettings

log = logging.getLogger(__name__)

MEDIA_DROPPED = Counter("examlops_engine_media_parts_dropped_total",
                        "Media parts removed from requests to text-only endpoints.", ["endpoint"])
#: What each route task answers, and how a call of another kind is named in the refusal.
_EMBED_KINDS = (pb.REQUEST_KIND_EMBEDDINGS,)
_KIND_CALLS: dict[int, str] = {pb.REQUEST_KIND_CHAT: "a chat completions call",
                               pb.REQUEST_KIND_COMPLETION: "a completions call",
                               pb.REQUEST_KIND_EMBEDDINGS: "an embeddings call"}
GENERATIONS = Counter("examlops_engine_generations_total", "Generate calls by endpoint and outcome.",
                      ["endpoint", "outcome"])


class EngineProxyServicer(pb_grpc.EngineProxyServicer):
    def __init__(self, settings: EngineProxySettings, table: RouteTable, pool: EnginePool,
                 mediaguard: mg_grpc.MediaGuardStub) -> None:
        self.settings = settings
        self.table = table
        self.pool = pool
        self.mediaguard = mediaguard
        self.streams: set[Multiplex] = set()  # the open Multiplex streams
        self.draining = False

    def resolve(self, name: str) -> reg.Endpoint:
        ep = self.table.get(name) or self.pool.pack_endpoint(name)
        if ep is None:
            known = ", ".join(sorted(e.name for e in self.table.routable())) or "none"
            raise RouteNotFound(f"no endpoint named {name!r} (routable: {known})", "model")
        reason = unroutable_reason(ep)
        if reason is not None:
            raise RouteNotFound(f"{reason}; it is not routed", "model")
        return ep

    @staticmethod
    def check_task(ep: reg.Endpoint, kind: int) -> None:
        """Refuse a call the route's task does not answer (the gateway checks first; this holds
        for every other caller)."""
        task = task_of(ep.engine_block_json)
        if (kind in _EMBED_KINDS) != (task == "embed"):
            call = _KIND_CALLS.get(kind, f"a call of kind {kind}")
            use = "/v1/embeddings" if task == "embed" else "/v1/chat/completions or /v1/completions"
            route = "an embedding" if task == "embed" else "a generation"
            raise TaskMismatch(f"model {ep.name!r} is {route} route (task: {task}): it does not answer "
                               f"{call}; use {use}", "model")

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        outcome = "error"
        try:
            async for chunk in self.answer(request, context):
                yield chunk
            outcome = "ok"
        except EngineError as exc:
            outcome = exc.reason
            await abort(context, exc.code, exc.reason, str(exc), exc.param)
        finally:
            GENERATIONS.labels(request.endpoint, outcome).inc()

    async def GenerateOnce(self, request: pb.GenerateRequest,
                           context: grpc.aio.ServicerContext) -> pb.GenerateChunk:
        """A non-streamed answer in one message (what Generate would send, merged)."""
        outcome = "error"
        try:
            answer: pb.GenerateChunk | None = None
            async for chunk in self.answer(request, context, once=True):
                if answer is None:
                    answer = chunk  # the usual whole answer: one message, nothing to copy
                else:
                    answer.MergeFrom(chunk)  # bytes and messages: the later one's; warnings: appended
            outcome = "ok"
            return answer if answer is not None else pb.GenerateChunk()
        except EngineError as exc:
            outcome = exc.reason
            await abort(context, exc.code, exc.reason, str(exc), exc.param)
        finally:
            GENERATIONS.labels(request.endpoint, outcome).inc()

    def Multiplex(self, requests: AsyncIterator[pb.MultiplexRequest],
                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MultiplexReply]:
        """Generate and GenerateOnce calls multiplexed on one stream (_multiplex)."""
        return Multiplex(self).replies(requests)

    def drain(self) -> None:
        """Shutting down: Multiplex streams take no new call and end once their open calls are answered."""
        self.draining = True
        for stream in list(self.streams):
            stream.drain()

    async def answer(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                     once: bool = False) -> AsyncIterator[pb.GenerateChunk]:
        """The answer's messages; raises EngineError. `once`: a non-streamed call (GenerateOnce)."""
        ep = self.resolve(request.endpoint)
        self.check_task(ep, request.kind)
        try:
            body: dict[str, Any] = orjson.loads(request.body_json)
        except orjson.JSONDecodeError:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request",
                        "request body is not JSON", "")
        stream = bool(body.get("stream")) and request.kind != pb.REQUEST_KIND_EMBEDDINGS
        if once and stream:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request",
                        "GenerateOnce answers a non-streamed request; call Generate for a stream", "stream")
        entry = self.pool.entry_for(ep)
        notes = [entry.warning] if entry.warning else []
        dropped = 0
        if request.kind == pb.REQUEST_KIND_CHAT and has_media(body.get("messages")):
            body["messages"], dropped = await guard_messages(
                self.mediaguard, ep.name, body["messages"], ep.engine_block_json)
            if dropped:
                MEDIA_DROPPED.labels(ep.name).inc(dropped)
                notes.append(f"endpoint {ep.name!r} is text-only: dropped {dropped} media part(s)")
                log.warning("%s", notes[-1])
        body["model"] = ep.served_model_name or ep.name
        opts = body.get("stream_options") if stream else None
        opts = opts if isinstance(opts, dict) else {}
        usage_chunk = bool(opts.get("include_usage"))
        usage_stats = usage_chunk and bool(opts.get("continuous_usage_stats"))
        gen = Generation(kind=request.kind, body=body, stream=stream, endpoint=ep.name,
                         want_usage_chunk=usage_chunk, want_usage_stats=usage_stats)
        pool = entry.pool
        key = affinity_key(pool.policy, request.kind, body, request.session_id) \
            if len(pool.replicas) > 1 else None
        first = True
        async for chunk in generate_over(pool, gen, key, self.attempts(context)):
            if first:
                chunk.media_parts_dropped = dropped
                chunk.warnings.extend(notes)
                first = False
            yield chunk

    def attempts(self, context: grpc.aio.ServicerContext) -> Attempts:
        s = self.settings
        remaining = context.time_remaining()
        return Attempts(max_attempts=s.max_attempts, eject_after=s.eject_after_failures,
                        first_byte_timeout_s=s.first_byte_timeout_s,
                        deadline=time.monotonic() + remaining if remaining is not None else None)

    async def ListRoutes(self, request: pb.ListRoutesRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListRoutesResponse:
        eps = sorted(self.table.endpoints.values(), key=lambda e: e.name)
        return pb.ListRoutesResponse(routes=[
            pb.Route(name=ep.name, engine=ep.engine, base_url=ep.base_url, state=state_name(ep.state),
                     routable=unroutable_reason(ep) is None, routing=routing_of(ep.engine_block_json),
                     replicas=self.replica_stats(ep))
            for ep in eps if not request.name or ep.name == request.name])

    def replica_stats(self, ep: reg.Endpoint) -> list[pb.ReplicaStats]:
        """What this proxy knows of each replica; the registry's list while no request used the pool."""
        entry = self.pool.entry(ep.name)
        if entry is not None:
            return entry.pool.stats()
        listed = list(ep.replicas) or routable_replicas(ep)
        return [pb.ReplicaStats(id=r.id, base_url=r.base_url, healthy=True, draining=r.draining, metrics_age_ms=-1)
                for r in listed]
