"""Launcher gRPC servicer: adapter dispatch, registry bookkeeping, discovery and health reconciliation.

The adapters do the substrate's part; everything after "a process was started and its address
may be known" is one code path, whatever the substrate, run for each replica of the pool.
Changing a live pool (Scale, AddReplica, RemoveReplica) is in _pool_ops.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.launcher.v1 import launcher_pb2_grpc as pb_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import abort, current_caller, state_name

from ._adapters import Adapter, HpcAdapter, LaunchError, LaunchSpec, Prepared, Submission, replicas_of
from ._pool_ops import PoolOps, as_replica
from ._probe import pool_metrics, read_metrics
from ._reconcile import ReplicaCheck
from ._registry_ops import RPC_TIMEOUT_S
from ._spec import launch_spec

log = logging.getLogger(__name__)
LIVE = (reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY)
#: The best state of a pool's replicas names the pool's (the registry derives it the same way).
RANK = (reg.ENDPOINT_STATE_FAILED, reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY)


def best(submissions: list[Submission]) -> Submission:
    return max(submissions, key=lambda s: RANK.index(s.state) if s.state in RANK else -1)


class LauncherServicer(PoolOps, pb_grpc.LauncherServicer):
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
            # Replacing: the old jobs go first, so their addresses can never be mistaken for the new ones'.
            try:
                await self._adapter(previous).stop_all(previous)
            except LaunchError as exc:
                await self._refuse(context, exc)
        try:
            submissions = await adapter.start(spec, prepared)
        except LaunchError as exc:
            await self._audit_failure(spec.name, spec.launcher, current_caller().name, exc)
            await self._refuse(context, exc)
        first = best(submissions)
        ep = reg.Endpoint(name=spec.name, base_url=submissions[0].base_url, launcher=spec.launcher,
                          job_id=submissions[0].job_id, project=spec.project, engine_block_json=spec.block_json,
                          state=first.state, state_reason=first.reason,  # type: ignore[arg-type]
                          model_version=request.model_version, replicas=[as_replica(s) for s in submissions])
        try:
            registered = await self.registry.RegisterEndpoint(
                reg.RegisterEndpointRequest(endpoint=ep, actor=current_caller().name, replace=request.replace),
                timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # Never leave a job running that no record knows of.
            if any(s.job_id for s in submissions):
                try:
                    await adapter.stop_all(ep)
                except LaunchError as undo:
                    log.error("jobs of %s are orphaned: %s", spec.name, undo)
            await self._registry_refused(context, exc)
        for sub in submissions:
            await self._record_new_job(sub.hpc_job, current_caller().name)
        reconciled, _ready, _detail, _checks = await self._reconcile(registered, current_caller().name, context)
        return pb.StartResponse(endpoint=reconciled, plan=prepared.plan)

    # --- Health / Status / Stop ---

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        ep = await self._get(request.name, context)
        ep, ready, detail, _checks = await self._reconcile(ep, current_caller().name, context)
        return pb.HealthResponse(endpoint=ep, ready=ready, detail=detail)

    async def _replica_status(self, ep: reg.Endpoint, replica: reg.Replica,
                              check: ReplicaCheck | None) -> pb.ReplicaStatus:
        """One replica's substrate view and live load."""
        view = check.view if check is not None else None
        if view is None and ep.state != reg.ENDPOINT_STATE_DISABLED:
            view = await self._adapter(ep).status(ep, replica)
        out = pb.ReplicaStatus(id=replica.id, base_url=replica.base_url, state=state_name(replica.state),
                               substrate=view.fields if view else {}, draining=replica.draining,
                               detail=check.detail if check is not None else replica.state_reason)
        if replica.base_url and ep.state != reg.ENDPOINT_STATE_STOPPED and replica.state != reg.ENDPOINT_STATE_STOPPED:
            metrics, error = await read_metrics(self.http, replica.base_url, self.settings.probe_timeout_s)
            out.metrics.update(metrics)
            if error:
                out.substrate["metrics"] = error
        return out

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        ep = await self._get(request.name, context)
        ep, _ready, detail, checks = await self._reconcile(ep, "launcher", context)
        by_id = {c.replica.id: c for c in checks}
        pool = replicas_of(ep)
        replicas = list(await asyncio.gather(*(self._replica_status(ep, r, by_id.get(r.id)) for r in pool)))
        substrate = {"launcher": ep.launcher or "external", "probe": detail}
        if replicas:
            # The first replica's view, where a single-server endpoint always had it.
            substrate.update(replicas[0].substrate)
        if len(replicas) > 1:
            ready = sum(r.state == "READY" for r in replicas)
            substrate["replicas"] = f"{ready}/{len(replicas)} ready"
            substrate.pop("metrics", None)
        metrics = pool_metrics([dict(r.metrics) for r in replicas])
        return pb.StatusResponse(endpoint=ep, substrate=substrate, metrics=metrics, replicas=replicas)

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext) -> pb.StopResponse:
        ep = await self._get(request.name, context)
        adapter = self._adapter(ep)
        pool = replicas_of(ep)
        plan = adapter.stop_plan(ep, pool)
        if request.dry_run:
            return pb.StopResponse(endpoint=ep, plan=plan)
        try:
            done = await adapter.stop_all(ep)
        except LaunchError as exc:
            await self._refuse(context, exc)
        actor = current_caller().name
        fields: dict[str, Any] = {"state": reg.ENDPOINT_STATE_STOPPED, "state_reason": done}
        if isinstance(adapter, HpcAdapter):
            # The jobs' addresses died with them.
            if len(pool) > 1:
                for r in pool:
                    if r.base_url and r.source != "external":
                        await self._update(context, ep.name, actor, "stop", base_url="", replica=r.id)
            else:
                fields["base_url"] = ""
        stopped = await self._update(context, ep.name, actor, "stop", **fields)
        for r in pool:
            if r.job_id and f"job {r.job_id} cancelled" in done:
                await self._record_job(ep, r.job_id, actor, "CANCELLED")
        return pb.StopResponse(endpoint=stopped, plan=plan)
