"""Changing a live pool: Scale, AddReplica, RemoveReplica.

New replicas start exactly as `start` would start them (the endpoint's block, launcher and
resources). A replica leaves in three steps: it is marked draining (engine-proxy sends it no new
request), the launcher waits until its server reports nothing running or waiting (at most the
drain timeout; one look only when it has no /metrics), then its job is stopped if the launcher
started one, and the registry forgets it. Surplus replicas go newest first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import grpc

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import abort, current_caller, state_name

from ._adapters import (
    Adapter,
    HpcAdapter,
    LaunchError,
    LaunchSpec,
    Submission,
    replica_number,
    replicas_of,
    started_here,
)
from ._adapters._compose import container_index
from ._adapters._kserve import KServeAdapter
from ._probe import read_metrics
from ._reconcile import Reconciler
from ._registry_ops import RPC_TIMEOUT_S
from ._spec import launch_spec

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.25


def next_ids(ep: reg.Endpoint, count: int) -> list[str]:
    """Ids after the highest in use (the number picks an HPC replica's port and endpoint file). A
    removed replica's id can come back; its endpoint file names its old job, so is never trusted."""
    top = max((replica_number(r.id) for r in replicas_of(ep)), default=-1)
    return [f"r{top + 1 + k}" for k in range(count)]


def describe(replica: reg.Replica) -> str:
    return f"{replica.id} ({replica.base_url or 'no address yet'})"


class PoolOps(Reconciler):
    async def _refuse_stopped(self, ep: reg.Endpoint, context: grpc.aio.ServicerContext) -> None:
        if ep.state == reg.ENDPOINT_STATE_STOPPED:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "endpoint_stopped",
                        f"endpoint {ep.name!r} is STOPPED; start it first (exa serve llm start {ep.name} ...)", "name")

    async def _spec_for(self, ep: reg.Endpoint, ids: list[str], context: grpc.aio.ServicerContext) -> LaunchSpec:
        """The spec a start of these replicas would have had: the endpoint's block, project and resources."""
        request = pb.StartRequest(name=ep.name, launcher=ep.launcher, engine_block_json=ep.engine_block_json,
                                  project=ep.project, model_version=ep.model_version)
        pool = replicas_of(ep)
        if isinstance(self._adapter(ep), HpcAdapter):
            jobs = await self._registry_call(context, self.registry.ListHpcJobs(
                reg.ListHpcJobsRequest(kind="serve", name=ep.name), timeout=RPC_TIMEOUT_S))
            ours = {r.job_id for r in pool}
            job = next((j for j in jobs.jobs if j.job_id in ours and j.scheduler == ep.launcher), None)
            if job is not None:
                request.nodes, request.gpus_per_node = job.nodes, job.gpus_per_node
                request.partition, request.walltime = job.partition, job.walltime
        # HPC replica rN serves on port + N: a published address tells the pool's base port.
        for r in pool:
            port = urlsplit(r.base_url).port if r.base_url and started_here(r) else None
            if port and port - replica_number(r.id) > 0:
                request.port = port - replica_number(r.id)
                break
        compose = [container_index(r.source) for r in pool if r.source.startswith("compose:")]
        try:
            spec = launch_spec(request)
        except LaunchError as exc:
            await self._refuse(context, exc)
        return dataclasses.replace(spec, replica_ids=tuple(ids), first_index=max(compose, default=0))

    # --- Scale ---

    async def Scale(self, request: pb.ScaleRequest, context: grpc.aio.ServicerContext) -> pb.PoolChangeResponse:
        if request.replicas < 1:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_replicas",
                        f"replicas must be at least 1 (got {request.replicas}); to stop every replica: "
                        f"exa serve llm stop {request.name}", "replicas")
        ep = await self._get(request.name, context)
        await self._refuse_stopped(ep, context)
        adapter = self._adapter(ep)
        if isinstance(adapter, KServeAdapter):
            try:
                plan = await adapter.rescale(ep.name, request.replicas, write=not request.dry_run)
            except LaunchError as exc:
                await self._refuse(context, exc)
            return pb.PoolChangeResponse(endpoint=ep, plan=plan, changes=[f"kserve:{ep.name}: {plan.summary}"])
        pool = [r for r in replicas_of(ep) if not r.draining]
        if request.replicas > len(pool):
            return await self._scale_up(ep, adapter, request.replicas - len(pool), request.dry_run, context)
        if request.replicas < len(pool):
            newest = sorted(pool, key=lambda r: replica_number(r.id), reverse=True)
            return await self._drain_and_remove(ep, newest[:len(pool) - request.replicas], request.drain_timeout_s,
                                                request.dry_run, context)
        return pb.PoolChangeResponse(endpoint=ep, changes=[f"{ep.name} already has {len(pool)} replica(s)"])

    async def _scale_up(self, ep: reg.Endpoint, adapter: Adapter, count: int, dry_run: bool,
                        context: grpc.aio.ServicerContext) -> pb.PoolChangeResponse:
        if adapter.name == "external":
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "external_needs_base_url",
                        f"endpoint {ep.name!r} uses the external launcher, which starts no server: add each "
                        f"server with exa serve llm replica add {ep.name} --base-url URL", "replicas")
        spec = await self._spec_for(ep, next_ids(ep, count), context)
        try:
            prepared = adapter.plan(spec)
        except LaunchError as exc:
            await self._refuse(context, exc)
        if dry_run:
            return pb.PoolChangeResponse(endpoint=ep, plan=prepared.plan, changes=[
                f"{rid}: would be started ({adapter.name})" for rid in spec.replica_ids])
        actor = current_caller().name
        try:
            submissions = await adapter.start(spec, prepared)
        except LaunchError as exc:
            await self._audit_failure(ep.name, ep.launcher, actor, exc, action="scale.failed")
            await self._refuse(context, exc)
        changes = []
        for k, sub in enumerate(submissions):
            try:
                ep = await self.registry.AddReplica(reg.AddReplicaRequest(
                    name=ep.name, replica=as_replica(sub), actor=actor), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                await self._undo(ep, adapter, submissions[k:])
                await self._registry_refused(context, exc)
            await self._record_new_job(sub.hpc_job, actor)
            changes.append(f"{sub.replica_id} started: {sub.reason}")
        ep, _ready, _detail, _checks = await self._reconcile(ep, actor, context)
        return pb.PoolChangeResponse(endpoint=ep, plan=prepared.plan, changes=changes)

    async def _undo(self, ep: reg.Endpoint, adapter: Adapter, submissions: Sequence[Submission]) -> None:
        """Never leave a job running that no record knows of."""
        for sub in submissions:
            try:
                await adapter.stop(ep, as_replica(sub))
            except LaunchError:
                pass

    # --- AddReplica ---

    async def AddReplica(self, request: pb.AddReplicaRequest,
                         context: grpc.aio.ServicerContext) -> pb.PoolChangeResponse:
        url = request.base_url.strip().rstrip("/")
        if not re.match(r"^https?://[^\s/]+$", url):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_base_url",
                        f"base URL {request.base_url!r} must be an http(s) URL like http://host:8000", "base_url")
        ep = await self._get(request.name, context)
        await self._refuse_stopped(ep, context)
        same = next((r for r in replicas_of(ep) if r.base_url == url), None)
        if same is not None:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, "replica_exists",
                        f"{url} is already replica {same.id} of {ep.name!r}", "base_url")
        (rid,) = next_ids(ep, 1)
        actor = current_caller().name
        added = reg.Replica(id=rid, base_url=url, state=reg.ENDPOINT_STATE_STARTING, source="external",
                            state_reason="added by operator; not probed yet")
        ep = await self._registry_call(context, self.registry.AddReplica(
            reg.AddReplicaRequest(name=ep.name, replica=added, actor=actor), timeout=RPC_TIMEOUT_S))
        replica = next((r for r in ep.replicas if r.base_url == url), added)
        check = await self._check(ep, replica)
        ep = await self._record_check(ep, check, actor, context)
        plan = pb.LaunchPlan(launcher=ep.launcher or "external",
                             summary=f"add {url} to the pool of {ep.name!r}; nothing is started")
        return pb.PoolChangeResponse(endpoint=ep, plan=plan, changes=[
            f"{replica.id} {url} added: {state_name(check.target)} ({check.detail})"])

    # --- RemoveReplica ---

    async def RemoveReplica(self, request: pb.RemoveReplicaRequest,
                            context: grpc.aio.ServicerContext) -> pb.PoolChangeResponse:
        ep = await self._get(request.name, context)
        key = request.replica.strip().rstrip("/")
        pool = replicas_of(ep)
        victim = next((r for r in pool if key and (r.id == key or r.base_url == key)), None)
        if victim is None:
            known = ", ".join(describe(r) for r in pool)
            await abort(context, grpc.StatusCode.NOT_FOUND, "replica_not_found",
                        f"endpoint {ep.name!r} has no replica {request.replica!r}; its replicas: {known}", "replica")
        if not any(r.id != victim.id and not r.draining for r in pool):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "last_replica",
                        f"{victim.id} is the last replica of {ep.name!r}; stop the endpoint instead: "
                        f"exa serve llm stop {ep.name}", "replica")
        return await self._drain_and_remove(ep, [victim], request.drain_timeout_s, request.dry_run, context)

    def _removal_plan(self, ep: reg.Endpoint, victims: Sequence[reg.Replica]) -> pb.LaunchPlan:
        adapter = self._adapter(ep)
        plan = pb.LaunchPlan(launcher=adapter.name, summary=(
            f"drain and remove {', '.join(describe(v) for v in victims)} from {ep.name!r}"))
        shrinking = reg.Endpoint()
        shrinking.CopyFrom(ep)
        for v in victims:
            if started_here(v):
                plan.commands.extend(adapter.stop_plan(shrinking, [v]).commands)
            kept = [r for r in shrinking.replicas if r.id != v.id]
            del shrinking.replicas[:]
            shrinking.replicas.extend(kept)
        return plan

    async def _drain_and_remove(self, ep: reg.Endpoint, victims: Sequence[reg.Replica], timeout_s: float,
                                dry_run: bool, context: grpc.aio.ServicerContext) -> pb.PoolChangeResponse:
        timeout_s = timeout_s if timeout_s > 0 else DEFAULT_DRAIN_TIMEOUT_S
        try:
            plan = self._removal_plan(ep, victims)
        except LaunchError as exc:
            await self._refuse(context, exc)
        if dry_run:
            return pb.PoolChangeResponse(endpoint=ep, plan=plan, changes=[
                f"{describe(v)}: would drain (at most {timeout_s:g} s), "
                f"{'stop its server' if started_here(v) else 'leave its server running (not ours)'} and forget it"
                for v in victims])
        actor = current_caller().name
        for v in victims:
            ep = await self._update(context, ep.name, actor, "drain", draining=True, replica=v.id)
        drained = await asyncio.gather(*(self._drain(v, timeout_s) for v in victims))
        adapter, changes = self._adapter(ep), []
        for v, how in zip(victims, drained, strict=True):
            done = "its server is not ours: left running"
            if started_here(v):
                try:
                    done = await adapter.stop(ep, v)
                except LaunchError as exc:
                    await self._audit_failure(ep.name, ep.launcher, actor, exc, action="replica.remove.failed")
                    await self._refuse(context, exc)
                if v.job_id and f"job {v.job_id} cancelled" in done:
                    await self._record_job(ep, v.job_id, actor, "CANCELLED")
            ep = await self._registry_call(context, self.registry.RemoveReplica(
                reg.RemoveReplicaRequest(name=ep.name, replica=v.id, actor=actor), timeout=RPC_TIMEOUT_S))
            changes.append(f"{describe(v)}: {how}; {done}; removed")
        return pb.PoolChangeResponse(endpoint=ep, plan=plan, changes=changes)

    async def _drain(self, replica: reg.Replica, timeout_s: float) -> str:
        """Wait until the server reports nothing running or waiting; one look when it cannot tell."""
        if not replica.base_url:
            return "nothing to drain (no address)"
        start = time.monotonic()
        while True:
            metrics, error = await read_metrics(self.http, replica.base_url, self.settings.probe_timeout_s)
            elapsed = time.monotonic() - start
            if error:
                return f"not waited for ({error})"
            busy = metrics.get("requests_running", 0.0) + metrics.get("requests_waiting", 0.0)
            if busy <= 0:
                return f"drained in {elapsed:.1f} s"
            if elapsed >= timeout_s:
                return f"drain timed out after {timeout_s:g} s with {busy:g} request(s) still in flight"
            await asyncio.sleep(min(DRAIN_POLL_S, timeout_s - elapsed))


def as_replica(sub: Submission) -> reg.Replica:
    return reg.Replica(id=sub.replica_id, base_url=sub.base_url, state=sub.state,  # type: ignore[arg-type]
                       source=sub.source, job_id=sub.job_id, state_reason=sub.reason)
