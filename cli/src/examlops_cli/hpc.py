"""`exa hpc …`: serving jobs on Slurm/Flux, and their Prometheus file_sd targets."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import orjson
import typer

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import state_name

from ._output import Ctx, console, emit_json, fail, message_dict, table
from ._rpc import call

app = typer.Typer(help="HPC (Slurm, Flux) jobs of the serving plane.", no_args_is_help=True)

HPC_LAUNCHERS = ("slurm", "flux")
#: Endpoints in these states are worth scraping (a STOPPED job's address is dead).
SCRAPED_STATES = (reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY, reg.ENDPOINT_STATE_FAILED)


@app.command()
def jobs(
    kind: Annotated[str, typer.Option(help="serve | train; empty: every kind.")] = "serve",
    name: Annotated[str, typer.Option(help="Only the jobs of this endpoint.")] = "",
) -> None:
    """Recorded HPC jobs, newest first."""
    resp = call("registry", "ListHpcJobs", reg.ListHpcJobsRequest(kind=kind, name=name))
    if Ctx.json:
        emit_json([message_dict(j) | {"submitted_at_ms": j.submitted_at_ms, "updated_at_ms": j.updated_at_ms,
                                      "nodes": j.nodes, "gpus_per_node": j.gpus_per_node} for j in resp.jobs])
        return
    table("HPC jobs", ["submitted", "scheduler", "job", "kind", "name", "state", "nodes", "gpus/node", "base_url"], [
        [dt.datetime.fromtimestamp(j.submitted_at_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), j.scheduler,
         j.job_id, j.kind, j.name, j.state, j.nodes, j.gpus_per_node, j.base_url] for j in resp.jobs])


def sd_targets(endpoints: list[reg.Endpoint], jobs: list[reg.HpcJob]) -> list[dict[str, Any]]:
    """Prometheus file_sd groups: one per replica of an HPC endpoint that has an address (each job of
    a pool is its own server), labelled with its endpoint, replica and job."""
    by_job = {(j.scheduler, j.job_id): j for j in jobs}
    groups = []
    for ep in sorted(endpoints, key=lambda e: e.name):
        if ep.launcher not in HPC_LAUNCHERS or ep.state not in SCRAPED_STATES:
            continue
        replicas = list(ep.replicas) or [reg.Replica(id="r0", base_url=ep.base_url, job_id=ep.job_id,
                                                     state=ep.state)]
        for rep in replicas:
            if not rep.base_url or rep.state not in SCRAPED_STATES:
                continue
            url = urlsplit(rep.base_url)
            labels = {"endpoint": ep.name, "replica": rep.id, "served_model_name": ep.served_model_name,
                      "launcher": ep.launcher, "scheduler": ep.launcher, "job_id": rep.job_id,
                      "project": ep.project, "state": state_name(rep.state), "__scheme__": url.scheme or "http",
                      "__metrics_path__": "/metrics"}
            job = by_job.get((ep.launcher, rep.job_id))
            if job is not None:
                labels |= {"partition": job.partition, "nodes": str(job.nodes),
                           "gpus_per_node": str(job.gpus_per_node), "transport": job.transport}
            port = url.port or (443 if url.scheme == "https" else 80)
            groups.append({"targets": [f"{url.hostname}:{port}"], "labels": {k: v for k, v in labels.items() if v}})
    return groups


@app.command("prometheus-sd")
def prometheus_sd(
    out: Annotated[Path, typer.Option(help="The file_sd JSON file to write (replaced atomically).")],
) -> None:
    """Write a Prometheus file_sd target list of the HPC endpoints (Prometheus re-reads it by itself)."""
    endpoints = call("registry", "ListEndpoints", reg.ListEndpointsRequest()).endpoints
    jobs = call("registry", "ListHpcJobs", reg.ListHpcJobsRequest(kind="serve")).jobs
    groups = sd_targets(list(endpoints), list(jobs))
    data = orjson.dumps(groups, option=orjson.OPT_INDENT_2) + b"\n"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Prometheus may read the file at any moment: never let it see half of one.
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    if Ctx.json:
        emit_json({"out": str(out), "targets": len(groups)})
    else:
        console.print(f"{len(groups)} HPC replica target(s) written to {out}", highlight=False)
