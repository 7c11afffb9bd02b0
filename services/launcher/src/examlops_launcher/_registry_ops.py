"""What every launcher RPC asks of the registry: reads, updates (per replica), audit and HPC job records."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

import grpc
import httpx

from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import abort, error_reason

from ._adapters import Adapter, HpcAdapter, LaunchError
from ._settings import LauncherSettings

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 10.0
T = TypeVar("T")


class RegistryOps:
    """What it asks of the registry names the authenticated operator as the actor it acts for
    (the registry audits the launcher as the actor, the operator as on_behalf_of); a request's own
    `actor` field is not evidence and is ignored."""

    def __init__(self, settings: LauncherSettings, registry: reg_grpc.RegistryStub, http: httpx.AsyncClient,
                 adapters: dict[str, Adapter]) -> None:
        self.settings = settings
        self.registry = registry
        self.http = http
        self.adapters = adapters

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, exc: LaunchError) -> NoReturn:
        await abort(context, exc.code, exc.reason, str(exc), exc.param)

    @staticmethod
    async def _registry_refused(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> NoReturn:
        """Pass the registry's refusal on to the caller, with its reason."""
        reason, param = error_reason(exc)
        await abort(context, exc.code(), reason or "registry_error", exc.details() or "", param)

    async def _registry_call(self, context: grpc.aio.ServicerContext, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except grpc.aio.AioRpcError as exc:
            await self._registry_refused(context, exc)

    async def _find(self, name: str, context: grpc.aio.ServicerContext) -> reg.Endpoint | None:
        try:
            ep: reg.Endpoint = await self.registry.GetEndpoint(reg.GetEndpointRequest(name=name), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            await self._registry_refused(context, exc)
        return ep

    async def _get(self, name: str, context: grpc.aio.ServicerContext) -> reg.Endpoint:
        ep: reg.Endpoint = await self._registry_call(
            context, self.registry.GetEndpoint(reg.GetEndpointRequest(name=name), timeout=RPC_TIMEOUT_S))
        return ep

    async def _update(self, context: grpc.aio.ServicerContext, name: str, actor: str, action: str,
                      **fields: Any) -> reg.Endpoint:
        """UpdateEndpoint; `replica=<id>` aims the fields at one replica of the pool."""
        ep: reg.Endpoint = await self._registry_call(context, self.registry.UpdateEndpoint(
            reg.UpdateEndpointRequest(name=name, actor=actor or "launcher", action=action, **fields),
            timeout=RPC_TIMEOUT_S))
        return ep

    def _adapter(self, ep: reg.Endpoint) -> Adapter:
        return self.adapters[ep.launcher or "external"]

    async def _audit_failure(self, spec_name: str, launcher: str, actor: str, exc: LaunchError,
                             action: str = "start.failed") -> None:
        event = reg.AuditEvent(actor=actor or "unknown", action=action, target=f"endpoint:{spec_name}",
                               after_json=json.dumps({"launcher": launcher, "reason": exc.reason, "error": str(exc)}))
        try:
            await self.registry.RecordAuditEvent(reg.RecordAuditEventRequest(event=event), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.warning("could not audit a failed %s of %s: %s", action, spec_name, err.details())

    async def _record_new_job(self, job: reg.HpcJob | None, actor: str) -> None:
        if job is None:
            return
        try:
            await self.registry.RecordHpcJob(reg.RecordHpcJobRequest(job=job, actor=actor), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not record HPC job %s: %s", job.job_id, exc.details())

    async def _record_job(self, ep: reg.Endpoint, job_id: str, actor: str, state: str = "", base_url: str = "") -> None:
        """Keep the kind=serve HPC job record of one replica's job in step with the scheduler (best effort)."""
        if not isinstance(self.adapters.get(ep.launcher), HpcAdapter) or not job_id:
            return
        try:
            jobs = await self.registry.ListHpcJobs(reg.ListHpcJobsRequest(kind="serve", name=ep.name),
                                                   timeout=RPC_TIMEOUT_S)
            job = next((j for j in jobs.jobs if j.job_id == job_id and j.scheduler == ep.launcher), None)
            if job is None or ((not state or job.state == state) and (not base_url or job.base_url == base_url)):
                return
            job.state = state or job.state
            job.base_url = base_url or job.base_url
            await self.registry.RecordHpcJob(reg.RecordHpcJobRequest(job=job, actor=actor or "launcher"),
                                             timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not update the HPC job record of %s: %s", ep.name, exc.details())
