"""Launcher gRPC servicer: adapter dispatch, registry bookkeeping, discovery and health reconciliation.

The adapters do the substrate's part; everything after "a process was started and its address
may be known" is this one code path, whatever the substrate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

import grpc
import httpx

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.launcher.v1 import launcher_pb2_grpc as pb_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import abort, current_caller, error_reason, state_name

from ._adapters import Adapter, HpcAdapter, LaunchError, LaunchSpec, Prepared, SubstrateView
from ._probe import probe, read_metrics
from ._settings import LauncherSettings
from ._spec import launch_spec

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 10.0
LIVE = (reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY)
T = TypeVar("T")


class LauncherServicer(pb_grpc.LauncherServicer):
    """What it asks of the registry names the authenticated operator as the actor it acts for
    (the registry audits the launcher as the actor, the operator as on_behalf_of); a request's own
    `actor` field is not evidence and is ignored."""

    def __init__(self, settings: LauncherSettings, registry: reg_grpc.RegistryStub, http: httpx.AsyncClient,
                 adapters: dict[str, Adapter]) -> None:
        self.settings = settings
        self.registry = registry
        self.http = http
        self.adapters = adapters

    # --- helpers ---

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, exc: LaunchError) -> NoReturn:
        await abort(context, exc.code, exc.reason, str(exc), exc.param)

    async def _registry_call(self, context: grpc.aio.ServicerContext, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except grpc.aio.AioRpcError as exc:
            reason, param = error_reason(exc)
            await abort(context, exc.code(), reason or "registry_error", exc.details() or "", param)

    async def _find(self, name: str, context: grpc.aio.ServicerContext) -> reg.Endpoint | None:
        try:
            ep: reg.Endpoint = await self.registry.GetEndpoint(reg.GetEndpointRequest(name=name), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            reason, param = error_reason(exc)
            await abort(context, exc.code(), reason or "registry_error", exc.details() or "", param)
        return ep

    async def _get(self, name: str, context: grpc.aio.ServicerContext) -> reg.Endpoint:
        ep: reg.Endpoint = await self._registry_call(
            context, self.registry.GetEndpoint(reg.GetEndpointRequest(name=name), timeout=RPC_TIMEOUT_S))
        return ep

    async def _update(self, context: grpc.aio.ServicerContext, name: str, actor: str, action: str,
                      **fields: Any) -> reg.Endpoint:
        ep: reg.Endpoint = await self._registry_call(context, self.registry.UpdateEndpoint(
            reg.UpdateEndpointRequest(name=name, actor=actor or "launcher", action=action, **fields),
            timeout=RPC_TIMEOUT_S))
        return ep

    def _adapter(self, ep: reg.Endpoint) -> Adapter:
        return self.adapters[ep.launcher or "external"]

    async def _audit_failure(self, spec_name: str, launcher: str, actor: str, exc: LaunchError) -> None:
        event = reg.AuditEvent(actor=actor or "unknown", action="start.failed", target=f"endpoint:{spec_name}",
                               after_json=json.dumps({"launcher": launcher, "reason": exc.reason, "error": str(exc)}))
        try:
            await self.registry.RecordAuditEvent(reg.RecordAuditEventRequest(event=event), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.warning("could not audit a failed start of %s: %s", spec_name, err.details())

    async def _record_job(self, ep: reg.Endpoint, actor: str, state: str = "", base_url: str = "") -> None:
        """Keep the kind=serve HPC job record in step with what the scheduler said (best effort)."""
        if not isinstance(self.adapters.get(ep.launcher), HpcAdapter) or not ep.job_id:
            return
        try:
            jobs = await self.registry.ListHpcJobs(reg.ListHpcJobsRequest(kind="serve", name=ep.name),
                                                   timeout=RPC_TIMEOUT_S)
            job = next((j for j in jobs.jobs if j.job_id == ep.job_id and j.scheduler == ep.launcher), None)
            if job is None or ((not state or job.state == state) and (not base_url or job.base_url == base_url)):
                return
            job.state = state or job.state
            job.base_url = base_url or job.base_url
            await self.registry.RecordHpcJob(reg.RecordHpcJobRequest(job=job, actor=actor or "launcher"),
                                             timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not update the HPC job record of %s: %s", ep.name, exc.details())

    # --- Plan / Start ---

    def _prepare(self, request: pb.StartRequest) -> tuple[LaunchSpec, Adapter, Prepared]:
        spec = launch_spec(request)
        adapter = self.adapters[spec.launcher]
        return spec, adapter, adapter.plan(spec)

    async def Plan(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.LaunchPlan:
        try:
            _spec, _adapter, prepared = self._prepare(request)
        except LaunchError as exc:
            await self._refuse(context, exc)
        return prepared.plan

    async def _check_conflicts(self, spec: LaunchSpec, adapter: Adapter, replace: bool,
                               context: grpc.aio.ServicerContext) -> reg.Endpoint | None:
        previous = await self._find(spec.name, context)
        # A queued job is as alive as a running one: starting again would orphan it.
        busy = previous is not None and (previous.state in LIVE or (
            previous.state == reg.ENDPOINT_STATE_PENDING and bool(previous.job_id)))
        if previous is not None and busy and not replace:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, "endpoint_exists",
                        f"endpoint {spec.name!r} is already {state_name(previous.state)}; stop it first "
                        f"(exa serve llm stop {spec.name}) or replace it (--replace)", "name")
        if getattr(adapter, "exclusive", False):
            listed = await self._registry_call(context, self.registry.ListEndpoints(
                reg.ListEndpointsRequest(states=[reg.ENDPOINT_STATE_PENDING, *LIVE]), timeout=RPC_TIMEOUT_S))
            holder = next((e for e in listed.endpoints if e.launcher == adapter.name and e.name != spec.name), None)
            if holder is not None:
                await abort(context, grpc.StatusCode.ALREADY_EXISTS, "substrate_busy",
                            f"the {adapter.name} vllm service already serves endpoint {holder.name!r}; "
                            f"stop it first (exa serve llm stop {holder.name})", "launcher")
        return previous

    async def Start(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.StartResponse:
        try:
            spec, adapter, prepared = self._prepare(request)
        except LaunchError as exc:
            await self._refuse(context, exc)
        previous = await self._check_conflicts(spec, adapter, request.replace, context)
        if previous is not None and previous.state != reg.ENDPOINT_STATE_STOPPED and previous.job_id:
            # Replacing: the old job goes first, so its address can never be mistaken for the new one's.
            try:
                await self._adapter(previous).stop(previous)
            except LaunchError as exc:
                await self._refuse(context, exc)
        try:
            submission = await adapter.start(spec, prepared)
        except LaunchError as exc:
            await self._audit_failure(spec.name, spec.launcher, current_caller().name, exc)
            await self._refuse(context, exc)
        ep = reg.Endpoint(name=spec.name, base_url=submission.base_url, launcher=spec.launcher,
                          job_id=submission.job_id, project=spec.project, engine_block_json=spec.block_json,
                          state=submission.state, state_reason=submission.reason,  # type: ignore[arg-type]
                          model_version=request.model_version)
        try:
            registered = await self.registry.RegisterEndpoint(
                reg.RegisterEndpointRequest(endpoint=ep, actor=current_caller().name, replace=request.replace),
                timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # Never leave a job running that no record knows of.
            if submission.job_id:
                try:
                    await adapter.stop(ep)
                except LaunchError as undo:
                    log.error("job %s of %s is orphaned: %s", submission.job_id, spec.name, undo)
            reason, param = error_reason(exc)
            await abort(context, exc.code(), reason or "registry_error", exc.details() or "", param)
        if submission.hpc_job is not None:
            try:
                await self.registry.RecordHpcJob(
                    reg.RecordHpcJobRequest(job=submission.hpc_job, actor=current_caller().name), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("could not record HPC job %s: %s", submission.job_id, exc.details())
        reconciled, _ready, _detail, _view = await self._reconcile(registered, current_caller().name, context)
        return pb.StartResponse(endpoint=reconciled, plan=prepared.plan)

    # --- discovery and reconciliation ---

    async def _discover(self, ep: reg.Endpoint, actor: str,
                        context: grpc.aio.ServicerContext) -> tuple[reg.Endpoint, SubstrateView | None]:
        """For a job that publishes its address: read the endpoint file once, and record the URL."""
        adapter = self._adapter(ep)
        if not isinstance(adapter, HpcAdapter) or ep.base_url:
            return ep, None
        view = await adapter.status(ep)
        if view.base_url:
            ep = await self._update(context, ep.name, actor, "discover", base_url=view.base_url,
                                    state=reg.ENDPOINT_STATE_STARTING,
                                    state_reason=f"job {ep.job_id} published {view.base_url}")
            await self._record_job(ep, actor, view.state, view.base_url)
        return ep, view

    def _judge(self, ep: reg.Endpoint, view: SubstrateView | None, ready: bool, detail: str) -> tuple[int, str]:
        """The state the endpoint should be in after a probe, and why."""
        if ready:
            return reg.ENDPOINT_STATE_READY, detail
        adapter = self._adapter(ep)
        if adapter.name == "kserve":
            return ep.state, "never applied by the launcher; apply the manifest with kubectl and register its URL"
        if view is not None and view.alive is False:
            if isinstance(adapter, HpcAdapter) and not ep.base_url:
                hint = " within its walltime" if view.state == "TIMEOUT" else ""
                return reg.ENDPOINT_STATE_FAILED, (
                    f"{view.detail}: it ended without publishing its address in "
                    f"{adapter.endpoint_file(ep.name)}{hint}; see {adapter.log_path(ep.name)}")
            return reg.ENDPOINT_STATE_FAILED, f"{view.detail}; {detail}"
        if view is not None and view.alive and ep.state in (reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING):
            if not ep.base_url and isinstance(adapter, HpcAdapter):
                return reg.ENDPOINT_STATE_PENDING, (
                    f"{view.detail}; waiting for it to publish {adapter.endpoint_file(ep.name)}")
            return reg.ENDPOINT_STATE_STARTING, f"{view.detail}; server not answering yet ({detail})"
        if view is not None and view.alive is None and view.detail and not ep.base_url:
            return ep.state, view.detail
        if not ep.base_url and ep.state in (reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING):
            return ep.state, detail
        return reg.ENDPOINT_STATE_FAILED, detail

    async def _reconcile(self, ep: reg.Endpoint, actor: str, context: grpc.aio.ServicerContext
                         ) -> tuple[reg.Endpoint, bool, str, SubstrateView | None]:
        """Discover, probe, then record the state when it changes (STOPPED/DISABLED are kept)."""
        if ep.state in (reg.ENDPOINT_STATE_STOPPED, reg.ENDPOINT_STATE_DISABLED):
            return ep, False, f"endpoint is {state_name(ep.state)}", None
        ep, view = await self._discover(ep, actor, context)
        ready, detail = await probe(self.http, ep, self.settings.probe_timeout_s)
        if not ready and view is None and ep.launcher in ("slurm", "flux", "compose") \
                and ep.state in (reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY):
            view = await self._adapter(ep).status(ep)
        target, why = self._judge(ep, view, ready, detail)
        if view is not None and view.state:
            await self._record_job(ep, actor, view.state)
        if target != ep.state or ep.state_reason != why:
            ep = await self._update(context, ep.name, actor, "health", state=target, state_reason=why)
        return ep, ready, why, view

    # --- Health / Status / Stop ---

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        ep = await self._get(request.name, context)
        ep, ready, detail, _view = await self._reconcile(ep, current_caller().name, context)
        return pb.HealthResponse(endpoint=ep, ready=ready, detail=detail)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        ep = await self._get(request.name, context)
        ep, _ready, detail, view = await self._reconcile(ep, "launcher", context)
        if view is None and ep.state != reg.ENDPOINT_STATE_DISABLED:
            view = await self._adapter(ep).status(ep)
        substrate = {"launcher": ep.launcher or "external", "probe": detail, **(view.fields if view else {})}
        metrics: dict[str, float] = {}
        if ep.base_url and ep.state != reg.ENDPOINT_STATE_STOPPED:
            metrics, error = await read_metrics(self.http, ep.base_url, self.settings.probe_timeout_s)
            if error:
                substrate["metrics"] = error
        return pb.StatusResponse(endpoint=ep, substrate=substrate, metrics=metrics)

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext) -> pb.StopResponse:
        ep = await self._get(request.name, context)
        adapter = self._adapter(ep)
        plan = adapter.stop_plan(ep)
        if request.dry_run:
            return pb.StopResponse(endpoint=ep, plan=plan)
        try:
            done = await adapter.stop(ep)
        except LaunchError as exc:
            await self._refuse(context, exc)
        fields: dict[str, Any] = {"state": reg.ENDPOINT_STATE_STOPPED, "state_reason": done}
        if isinstance(adapter, HpcAdapter):
            fields["base_url"] = ""          # the job's address died with it
        stopped = await self._update(context, ep.name, current_caller().name, "stop", **fields)
        if "cancelled" in done:
            await self._record_job(ep, current_caller().name, "CANCELLED")
        return pb.StopResponse(endpoint=stopped, plan=plan)
