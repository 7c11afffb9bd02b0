"""HPC job records (`hpc_jobs`): what the platform submitted to Slurm or Flux, by kind.

  {exa:reg}:hpc_jobs  HASH  "<scheduler>:<job_id>" -> HpcJob (protobuf JSON)

The `kind` discriminator is the point: a training poller waits for a terminal state, which a
healthy server never reaches, so serving jobs (kind=serve) must never enter it. A record and its
audit event are written in one MULTI/EXEC guarded by WATCH, like endpoint records.
"""

from __future__ import annotations

from typing import Any

import grpc
import redis.asyncio as redis
from redis.exceptions import WatchError

from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._checks import refuse_first
from ._store import AUDIT, RegistryStore, from_json, now_ms, to_json

HPC_JOBS = "{exa:reg}:hpc_jobs"
SCHEDULERS = ("slurm", "flux")
KINDS = ("serve", "train")


class HpcJobStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def record(self, job: pb.HpcJob, actor: str) -> pb.HpcJob:
        """Create or replace the record of (scheduler, job_id); the first submission time stays."""
        key = f"{job.scheduler}:{job.job_id}"
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(HPC_JOBS)
                    raw = await pipe.hget(HPC_JOBS, key)
                    before = from_json(raw, pb.HpcJob) if raw is not None else None
                    after = pb.HpcJob()
                    after.CopyFrom(job)
                    t = now_ms()
                    after.updated_at_ms = t
                    after.submitted_at_ms = (before.submitted_at_ms if before is not None
                                             else job.submitted_at_ms or t)
                    after_json = to_json(after)
                    pipe.multi()
                    pipe.hset(HPC_JOBS, key, after_json)
                    caller, on_behalf_of = current_caller().attribute(actor)
                    pipe.xadd(AUDIT, RegistryStore._audit_fields(
                        caller, "hpc_job.record", f"hpc_job:{key}",
                        to_json(before) if before is not None else "", after_json, t, on_behalf_of))
                    await pipe.execute()
                    return after
                except WatchError:
                    continue

    async def list(self, kind: str = "", name: str = "") -> list[pb.HpcJob]:
        jobs = [from_json(v, pb.HpcJob) for v in (await self.r.hgetall(HPC_JOBS)).values()]
        jobs = [j for j in jobs if (not kind or j.kind == kind) and (not name or j.name == name)]
        return sorted(jobs, key=lambda j: (j.submitted_at_ms, j.job_id), reverse=True)


class HpcJobServicerMixin:
    """RecordHpcJob and ListHpcJobs of the Registry service."""

    hpc_jobs: HpcJobStore

    async def RecordHpcJob(self, request: pb.RecordHpcJobRequest, context: grpc.aio.ServicerContext) -> pb.HpcJob:
        job = request.job
        problems = [
            ("scheduler", job.scheduler not in SCHEDULERS, f"scheduler must be one of {', '.join(SCHEDULERS)}"),
            ("job_id", not job.job_id, "a job record needs the scheduler's job_id"),
            ("kind", job.kind not in KINDS, f"kind must be one of {', '.join(KINDS)}"),
            ("name", not job.name, "a job record needs the name of what it runs"),
        ]
        await refuse_first(context, "invalid_hpc_job", problems)
        return await self.hpc_jobs.record(job, request.actor)

    async def ListHpcJobs(self, request: pb.ListHpcJobsRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListHpcJobsResponse:
        if request.kind and request.kind not in KINDS:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_hpc_job",
                        f"unknown kind {request.kind!r}; accepted: {', '.join(KINDS)}", "kind")
        return pb.ListHpcJobsResponse(jobs=await self.hpc_jobs.list(request.kind, request.name))
