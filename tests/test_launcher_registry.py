"""HPC job records in the registry: kind=serve kept apart from training jobs, audited, validated."""

from __future__ import annotations

import grpc
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import error_reason
from examlops_testsupport.fixtures import Stack


def test_hpc_jobs_are_recorded_by_kind_and_audited(stack: Stack) -> None:
    registry = stack.registry()
    serve = reg.HpcJob(scheduler="slurm", job_id="9001", kind="serve", name="reg-serve", state="PENDING",
                       nodes=2, gpus_per_node=4, submitted_at_ms=1)
    first = registry.RecordHpcJob(reg.RecordHpcJobRequest(job=serve, actor="tests"), timeout=10)
    registry.RecordHpcJob(reg.RecordHpcJobRequest(job=reg.HpcJob(
        scheduler="flux", job_id="f2x", kind="train", name="reg-train", state="RUN"), actor="tests"), timeout=10)
    serve.state, serve.submitted_at_ms = "RUNNING", 0
    updated = registry.RecordHpcJob(reg.RecordHpcJobRequest(job=serve, actor="tests"), timeout=10)
    assert updated.submitted_at_ms == first.submitted_at_ms == 1 and updated.state == "RUNNING"

    served = registry.ListHpcJobs(reg.ListHpcJobsRequest(kind="serve", name="reg-serve"), timeout=10).jobs
    assert [(j.job_id, j.state, j.nodes * j.gpus_per_node) for j in served] == [("9001", "RUNNING", 8)]
    # The training poller's view never holds a serving job.
    trained = registry.ListHpcJobs(reg.ListHpcJobsRequest(kind="train"), timeout=10).jobs
    assert {j.kind for j in trained} == {"train"} and "reg-serve" not in {j.name for j in trained}
    events = registry.ListAuditEvents(reg.ListAuditEventsRequest(target="hpc_job:slurm:9001"), timeout=10).events
    assert [e.action for e in events] == ["hpc_job.record", "hpc_job.record"]


@pytest.mark.parametrize(("job", "param"), [
    (reg.HpcJob(scheduler="pbs", job_id="1", kind="serve", name="x"), "scheduler"),
    (reg.HpcJob(scheduler="slurm", job_id="", kind="serve", name="x"), "job_id"),
    (reg.HpcJob(scheduler="slurm", job_id="1", kind="batch", name="x"), "kind"),
    (reg.HpcJob(scheduler="slurm", job_id="1", kind="serve", name=""), "name"),
])
def test_invalid_hpc_job_records_are_refused(stack: Stack, job: reg.HpcJob, param: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stack.registry().RecordHpcJob(reg.RecordHpcJobRequest(job=job, actor="tests"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error_reason(info.value) == ("invalid_hpc_job", param)  # type: ignore[arg-type]
