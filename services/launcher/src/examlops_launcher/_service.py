"""Launcher gRPC servicer: adapter dispatch, registry bookkeeping, health reconciliation."""

from __future__ import annotations

import grpc
import httpx

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.launcher.v1 import launcher_pb2_grpc as pb_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import abort, error_reason, state_name

from ._probe import probe
from ._settings import LauncherSettings

LAUNCHERS = ("external", "compose", "slurm", "flux", "kserve")
RPC_TIMEOUT_S = 10.0


class LauncherServicer(pb_grpc.LauncherServicer):
    def __init__(self, settings: LauncherSettings, registry: reg_grpc.RegistryStub, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.registry = registry
        self.http = http

    async def _check_launcher(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> str:
        name = request.launcher or "external"
        if name not in LAUNCHERS:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "unknown_launcher",
                        f"unknown launcher {name!r}; accepted: {', '.join(LAUNCHERS)}", "launcher")
        if name != "external":
            await abort(context, grpc.StatusCode.UNIMPLEMENTED, "launcher_not_implemented",
                        f"launcher {name!r} is not implemented yet; use --launcher external with --base-url",
                        "launcher")
        return name

    async def _registry_call(self, context: grpc.aio.ServicerContext, coro):  # type: ignore[no-untyped-def]
        try:
            return await coro
        except grpc.aio.AioRpcError as exc:
            reason, param = error_reason(exc)
            await abort(context, exc.code(), reason or "registry_error", exc.details() or "", param)

    async def Plan(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.LaunchPlan:
        launcher = await self._check_launcher(request, context)
        where = request.base_url or "(no address: engine-proxy answers)"
        return pb.LaunchPlan(launcher=launcher, summary=(
            f"register endpoint {request.name!r} at {where}; the external launcher starts nothing"))

    async def Start(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.StartResponse:
        plan = await self.Plan(request, context)
        ep = reg.Endpoint(name=request.name, base_url=request.base_url, launcher=plan.launcher,
                          project=request.project, engine_block_json=request.engine_block_json,
                          state=reg.ENDPOINT_STATE_STARTING)
        registered = await self._registry_call(context, self.registry.RegisterEndpoint(
            reg.RegisterEndpointRequest(endpoint=ep, actor=request.actor, replace=request.replace),
            timeout=RPC_TIMEOUT_S))
        reconciled, _ready, _detail = await self._reconcile(registered, request.actor, context)
        return pb.StartResponse(endpoint=reconciled, plan=plan)

    async def _reconcile(self, ep: reg.Endpoint, actor: str,
                         context: grpc.aio.ServicerContext) -> tuple[reg.Endpoint, bool, str]:
        """Probe, then record READY or FAILED when the state changes (STOPPED/DISABLED are kept)."""
        ready, detail = await probe(self.http, ep, self.settings.probe_timeout_s)
        if ep.state in (reg.ENDPOINT_STATE_STOPPED, reg.ENDPOINT_STATE_DISABLED):
            return ep, False, f"endpoint is {state_name(ep.state)}"
        if ready:
            target = reg.ENDPOINT_STATE_READY
        elif not ep.base_url and ep.state == reg.ENDPOINT_STATE_PENDING:
            target = reg.ENDPOINT_STATE_PENDING
        elif ep.state == reg.ENDPOINT_STATE_STARTING and not ep.base_url:
            target = reg.ENDPOINT_STATE_STARTING
        else:
            target = reg.ENDPOINT_STATE_FAILED
        if target != ep.state or ep.state_reason != detail:
            ep = await self._registry_call(context, self.registry.UpdateEndpoint(reg.UpdateEndpointRequest(
                name=ep.name, state=target, state_reason=detail, actor=actor or "launcher", action="health"),
                timeout=RPC_TIMEOUT_S))
        return ep, ready, detail

    async def _get(self, name: str, context: grpc.aio.ServicerContext) -> reg.Endpoint:
        ep: reg.Endpoint = await self._registry_call(
            context, self.registry.GetEndpoint(reg.GetEndpointRequest(name=name), timeout=RPC_TIMEOUT_S))
        return ep

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        ep = await self._get(request.name, context)
        ep, ready, detail = await self._reconcile(ep, request.actor, context)
        return pb.HealthResponse(endpoint=ep, ready=ready, detail=detail)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        ep = await self._get(request.name, context)
        return pb.StatusResponse(endpoint=ep, substrate={"launcher": ep.launcher or "external"})

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext) -> pb.StopResponse:
        ep = await self._get(request.name, context)
        if ep.launcher not in ("", "external"):
            await abort(context, grpc.StatusCode.UNIMPLEMENTED, "launcher_not_implemented",
                        f"stopping a {ep.launcher!r} endpoint is not implemented yet", "launcher")
        stopped = await self._registry_call(context, self.registry.UpdateEndpoint(reg.UpdateEndpointRequest(
            name=ep.name, state=reg.ENDPOINT_STATE_STOPPED, state_reason="stopped by operator",
            actor=request.actor, action="stop"), timeout=RPC_TIMEOUT_S))
        return pb.StopResponse(endpoint=stopped)
