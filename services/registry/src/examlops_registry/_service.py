"""The Registry gRPC servicer: validation and state rules over RegistryStore."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc

from examlops.registry.v1 import registry_pb2 as pb
from examlops.registry.v1 import registry_pb2_grpc as pb_grpc
from examlops.svc import abort, current_caller, state_name

from ._checks import Refused, answer
from ._hpc_jobs import HpcJobServicerMixin, HpcJobStore
from ._judges import JudgesServicerMixin, JudgeStore
from ._prices import PricesServicerMixin, PriceStore
from ._replicas import InvalidEndpoint, add_replica, apply_update, checked_base_url, normalise_replicas, remove_replica
from ._store import Conflict, NotFound, RegistryStore
from ._trust import TrustServicerMixin, TrustStore
from ._versions import VersionsServicerMixin, VersionStore

Ctx: TypeAlias = grpc.aio.ServicerContext
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
ENGINES = ("vllm-server", "vllm-inproc", "sglang", "echo")
ENGINE_ALIASES = {"vllm": "vllm-server"}
LAUNCHERS = ("external", "compose", "slurm", "flux", "kserve")
LIVE_STATES = (pb.ENDPOINT_STATE_STARTING, pb.ENDPOINT_STATE_READY)


def audited(claimed: str, action: str) -> tuple[str, str, str]:
    """(actor, action, on_behalf_of) of the current call: the credential's name, and what a service claims."""
    actor, on_behalf_of = current_caller().attribute(claimed)
    return actor, action, on_behalf_of


def normalise_registration(ep: pb.Endpoint) -> pb.Endpoint:
    """Check a registration and fill its defaults; InvalidEndpoint names the field."""
    out = pb.Endpoint()
    out.CopyFrom(ep)
    if not NAME_RE.match(out.name):
        raise InvalidEndpoint("name", f"invalid endpoint name {out.name!r}: use 1-63 characters of "
                                      "a-z, 0-9, '.', '_' or '-', starting with a letter or digit")
    block: dict[str, object] = {}
    if out.engine_block_json:
        from examlops.engine import EngineBlockError, parse_engine_block

        try:
            raw = json.loads(out.engine_block_json)
        except json.JSONDecodeError as exc:
            raise InvalidEndpoint("engine_block_json", f"engine block is not JSON: {exc}") from None
        try:
            parsed = parse_engine_block(raw)
        except EngineBlockError as exc:
            raise InvalidEndpoint("engine_block", f"invalid engine block for {out.name!r}:\n{exc}") from None
        block = parsed.model_dump(mode="json", exclude_none=True)
        out.engine_block_json = json.dumps(block, sort_keys=True)
    engine = out.engine or str(block.get("engine") or "vllm-server")
    engine = ENGINE_ALIASES.get(engine, engine)
    if engine not in ENGINES:
        raise InvalidEndpoint("engine", f"unknown engine {engine!r}; accepted: {', '.join(ENGINES)}")
    out.engine = engine
    out.launcher = out.launcher or "external"
    if out.launcher not in LAUNCHERS:
        raise InvalidEndpoint("launcher", f"unknown launcher {out.launcher!r}; accepted: {', '.join(LAUNCHERS)}")
    out.base_url = checked_base_url(out.base_url, "base_url")
    out.served_model_name = out.served_model_name or str(block.get("served_model_name") or out.name)
    if out.state == pb.ENDPOINT_STATE_UNSPECIFIED:
        out.state = pb.ENDPOINT_STATE_PENDING
    normalise_replicas(out)
    return out


class RegistryServicer(HpcJobServicerMixin, PricesServicerMixin, VersionsServicerMixin, TrustServicerMixin,
                       JudgesServicerMixin, pb_grpc.RegistryServicer):
    def __init__(self, store: RegistryStore) -> None:
        self.store = store
        self.hpc_jobs = HpcJobStore(store.r)
        self.prices = PriceStore(store.r)
        self.versions = VersionStore(store.r)
        self.keys = TrustStore(store.r)
        self.judges = JudgeStore(store.r)

    async def RegisterEndpoint(self, request: pb.RegisterEndpointRequest, context: Ctx) -> pb.Endpoint:
        try:
            ep = normalise_registration(request.endpoint)
        except InvalidEndpoint as exc:
            await abort(context, exc.code, exc.reason, str(exc), exc.field)

        def change(before: pb.Endpoint | None) -> pb.Endpoint:
            if before is not None and before.state in LIVE_STATES and not request.replace:
                raise Conflict(f"endpoint {ep.name!r} is already {state_name(before.state)}; "
                               "stop it first (exa serve llm stop) or replace it")
            return ep

        try:
            after = await self.store.mutate(ep.name, change, *audited(request.actor, "register"))
        except Conflict as exc:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, "endpoint_exists", str(exc), "name")
        assert after is not None
        return after

    async def GetEndpoint(self, request: pb.GetEndpointRequest, context: Ctx) -> pb.Endpoint:
        try:
            return await self.store.get(request.name)
        except NotFound:
            await abort(context, grpc.StatusCode.NOT_FOUND, "endpoint_not_found",
                        f"no endpoint named {request.name!r}", "name")

    async def ListEndpoints(self, request: pb.ListEndpointsRequest, context: Ctx) -> pb.ListEndpointsResponse:
        states = set(request.states)
        eps = [ep for ep in await self.store.list()
               if (not request.project or ep.project == request.project)
               and (not states or ep.state in states)]
        return pb.ListEndpointsResponse(endpoints=eps)

    async def UpdateEndpoint(self, request: pb.UpdateEndpointRequest, context: Ctx) -> pb.Endpoint:
        if request.HasField("state") and request.state == pb.ENDPOINT_STATE_UNSPECIFIED:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_endpoint",
                        "state must be set to a real state", "state")

        def change(after: pb.Endpoint) -> None:
            apply_update(after, request)

        return await answer(context, self._change(request.name, change, request.actor, request.action or "update"))

    async def AddReplica(self, request: pb.AddReplicaRequest, context: Ctx) -> pb.Endpoint:
        def change(after: pb.Endpoint) -> None:
            add_replica(after, request.replica)

        return await answer(context, self._change(request.name, change, request.actor, "replica.add"))

    async def RemoveReplica(self, request: pb.RemoveReplicaRequest, context: Ctx) -> pb.Endpoint:
        def change(after: pb.Endpoint) -> None:
            remove_replica(after, request.replica)

        return await answer(context, self._change(request.name, change, request.actor, "replica.remove"))

    async def _change(self, name: str, change: Callable[[pb.Endpoint], None], actor: str,
                      action: str) -> pb.Endpoint:
        """Apply `change` to a copy of endpoint `name` through the store (audited, watched)."""
        def mutation(before: pb.Endpoint | None) -> pb.Endpoint:
            if before is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, "endpoint_not_found", f"no endpoint named {name!r}", "name")
            after = pb.Endpoint()
            after.CopyFrom(before)
            change(after)
            return after

        after = await self.store.mutate(name, mutation, *audited(actor, action))
        assert after is not None
        return after

    async def RemoveEndpoint(self, request: pb.RemoveEndpointRequest, context: Ctx) -> pb.RemoveEndpointResponse:
        try:
            before = await self.store.get(request.name)
            await self.store.mutate(request.name, lambda _b: None, *audited(request.actor, "remove"))
        except NotFound:
            await abort(context, grpc.StatusCode.NOT_FOUND, "endpoint_not_found",
                        f"no endpoint named {request.name!r}", "name")
        return pb.RemoveEndpointResponse(removed=before)

    async def WatchEndpoints(self, request: pb.WatchEndpointsRequest, context: Ctx) -> AsyncIterator[pb.EndpointEvent]:
        async for event in self.store.watch():
            yield event

    async def RecordAuditEvent(self, request: pb.RecordAuditEventRequest, context: Ctx) -> pb.AuditEvent:
        if not request.event.action or not request.event.target:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_audit_event",
                        "an audit event needs an action and a target", "event")
        event = pb.AuditEvent()
        event.CopyFrom(request.event)
        event.actor, event.on_behalf_of = current_caller().attribute(request.event.actor)
        return await self.store.record_audit(event)

    async def ListAuditEvents(self, request: pb.ListAuditEventsRequest, context: Ctx) -> pb.ListAuditEventsResponse:
        limit = request.limit if request.limit > 0 else 100
        events = await self.store.list_audit(min(limit, 10_000), request.target, request.action)
        return pb.ListAuditEventsResponse(events=events)
