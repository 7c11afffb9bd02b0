"""What Slurm and Flux share: the job script, staging, the endpoint file, submit/cancel through a transport.

A serving job publishes `<work_dir>/<name>.endpoint` (its head's URL, then `job=<id>`) as soon
as its head node is known. A pool is one job per replica: replica rN (N > 0) has its own script,
`<name>.rN.endpoint` and port (the start's port + N, so replicas sharing a node never collide);
r0 keeps the single-server names. The launcher never scrapes the scheduler for an address: it reads
that file, through the same transport it submitted with, and only trusts it when the job id in
it is the endpoint's current job, so a restarted endpoint never inherits an old address.
"""

from __future__ import annotations

import logging
import re
import shlex
import time
from abc import abstractmethod
from collections.abc import Sequence
from functools import cache
from typing import ClassVar

import grpc
import jinja2

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg

from .._settings import LauncherSettings
from .._transport import CommandResult, Transport, TransportError
from ._base import (
    Adapter,
    LaunchError,
    LaunchSpec,
    Prepared,
    Submission,
    SubstrateView,
    redacted,
    render,
    replica_number,
    split_env,
)

log = logging.getLogger(__name__)

#: vLLM needs Ray to spread one server over several nodes.
RAY_BACKEND = ["--distributed-executor-backend", "ray"]
RAY_WAIT_S = 300
_WALLTIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def walltime_seconds(value: str) -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds."""
    m = _WALLTIME.match(value.strip())
    if not m:
        raise ValueError(value)
    d, b, c = (int(x) if x is not None else None for x in m.group("d", "b", "c"))
    a = int(m.group("a"))
    if d is not None:                       # D-HH[:MM[:SS]]
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:                       # HH:MM:SS
        return a * 3600 + (b or 0) * 60 + c
    if b is not None:                       # MM:SS
        return a * 60 + b
    return a * 60                           # MM


def parse_endpoint_file(text: str, job_id: str) -> str:
    """The URL in an endpoint file, or "" when it is not `job_id`'s (or not an endpoint file)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not re.match(r"^https?://[^\s/]+$", lines[0]):
        return ""
    owners = [line.removeprefix("job=") for line in lines[1:] if line.startswith("job=")]
    if owners and owners[0] != job_id:
        return ""
    return lines[0]


@cache
def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("examlops_launcher", "templates"),
        undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
        trim_blocks=False, lstrip_blocks=False)
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    return env


def sif_name(image: str) -> str:
    """docker://vllm/vllm-openai:latest → vllm-vllm-openai-latest.sif"""
    bare = image.split("://", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", bare).strip("-") + ".sif"


class HpcAdapter(Adapter):
    """Slurm and Flux: a rendered job script, staged and submitted through the transport."""

    scheduler: ClassVar[str]
    #: Scheduler states after which the job never publishes (or serves) again.
    terminal_states: ClassVar[frozenset[str]]
    log_pattern: ClassVar[str]       # the scheduler's placeholder for the job id in --output

    def __init__(self, settings: LauncherSettings, transport: Transport) -> None:
        super().__init__(settings)
        self.transport = transport

    # --- scheduler specifics ---

    @abstractmethod
    def submit_argv(self, script_path: str) -> list[str]: ...

    @abstractmethod
    def parse_job_id(self, result: CommandResult) -> str: ...

    @abstractmethod
    def cancel_argv(self, job_id: str) -> list[str]: ...

    @abstractmethod
    def already_gone(self, result: CommandResult) -> bool:
        """A cancel that failed only because the job had already ended."""

    @abstractmethod
    async def job_state(self, job_id: str) -> tuple[str, dict[str, str]]:
        """(state, fields); state GONE when the scheduler no longer knows the job."""

    # --- paths ---

    def work_dir(self) -> str:
        return self.settings.vllm_work_dir.rstrip("/") or "/"

    def _suffix(self, replica_id: str) -> str:
        # The first replica keeps the single-server names, so a pool of one is what it always was.
        return f".{replica_id}" if replica_number(replica_id) else ""

    def endpoint_file(self, name: str, replica_id: str = "") -> str:
        return f"{self.work_dir()}/{name}{self._suffix(replica_id)}.endpoint"

    def script_path(self, name: str, replica_id: str = "") -> str:
        return f"{self.work_dir()}/{name}{self._suffix(replica_id)}.{self.scheduler}.sh"

    def log_path(self, name: str) -> str:
        return f"{self.work_dir()}/{name}-{self.log_pattern}.log"

    # --- the interface ---

    def _check_resources(self, spec: LaunchSpec) -> int:
        if spec.nodes < 1:
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_resources",
                              f"--nodes must be at least 1 (got {spec.nodes})", "nodes")
        if spec.gpus_per_node < 0:
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_resources",
                              f"--gpus must be 0 or more per node (got {spec.gpus_per_node})", "gpus_per_node")
        workers, gpus = spec.tp * spec.pp, spec.nodes * spec.gpus_per_node
        if spec.gpus_per_node and workers > gpus:
            raise LaunchError(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_resources",
                f"--tp {spec.tp} x --pp {spec.pp} = {workers} GPU workers, but {spec.nodes} node(s) x "
                f"{spec.gpus_per_node} GPU(s) per node = {gpus} GPUs", "gpus_per_node")
        if not spec.walltime:
            return 0
        try:
            return walltime_seconds(spec.walltime)
        except ValueError:
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_walltime",
                              f"--walltime {spec.walltime!r} is not a time: use HH:MM:SS, MM or D-HH:MM:SS",
                              "walltime") from None

    def _script(self, spec: LaunchSpec, replica_id: str, walltime_s: int) -> tuple[list[str], dict[str, str], str]:
        """(vllm argv, its environment, the job script) of one replica: its own port and endpoint file."""
        port = spec.port + replica_number(replica_id)
        command = render(spec, host="0.0.0.0", port=port)
        serve_args = command.argv[1:]
        if spec.nodes > 1 and "--distributed-executor-backend" not in serve_args:
            serve_args += RAY_BACKEND
        plain, secret = split_env(command.env)
        s = self.settings
        suffix = f"-{replica_id}" if replica_number(replica_id) else ""
        script = _templates().get_template("vllm_serve.sh.j2").render(
            scheduler=self.scheduler, name=spec.name, job_name=f"exa-serve-{spec.name}{suffix}",
            nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, partition=spec.partition,
            walltime=spec.walltime, walltime_s=walltime_s, account=s.hpc_account,
            work_dir=self.work_dir(), endpoint_file=self.endpoint_file(spec.name, replica_id),
            log_path=self.log_path(spec.name), port=port,
            env={**s.vllm_job_env, **plain}, secret_env=sorted(secret), modules=s.modules,
            runtime=s.vllm_runtime, image=s.vllm_image, sif_path=f"{self.work_dir()}/images/{sif_name(s.vllm_image)}",
            vllm_bin=s.vllm_bin, serve_args=serve_args, ray_port=s.ray_port, ray_wait_s=RAY_WAIT_S)
        return ["vllm", *serve_args], command.env, script

    def plan(self, spec: LaunchSpec) -> Prepared:
        walltime_s = self._check_resources(spec)
        plan = pb.LaunchPlan(launcher=self.name, transport=self.transport.describe(),
                             endpoint_file=self.endpoint_file(spec.name, spec.replica_ids[0]))
        secret: dict[str, str] = {}
        for rid in spec.replica_ids:
            argv, env, script = self._script(spec, rid, walltime_s)
            path = self.script_path(spec.name, rid)
            if not plan.script:
                plan.argv.extend(argv)
                plan.env.update(redacted(env))
                plan.script = script
                secret = split_env(env)[1]
            plan.files[path] = script
            plan.commands.extend([f"write {path} ({self.transport.describe()})", shlex.join(self.submit_argv(path))])
        gpus = f", {spec.gpus_per_node} GPU(s) per node" if spec.gpus_per_node else ""
        files = ", ".join(self.endpoint_file(spec.name, rid) for rid in spec.replica_ids)
        jobs = f"{len(spec.replica_ids)} {self.scheduler} jobs (one per replica)" if len(spec.replica_ids) > 1 \
            else f"a {self.scheduler} job"
        plan.summary = (f"submit {jobs} serving {spec.block.hf_model_id if spec.block else ''} "
                        f"as {spec.name!r} on {spec.nodes} node(s){gpus} (tp {spec.tp}, pp {spec.pp}"
                        f"{', Ray across nodes' if spec.nodes > 1 else ''}); each publishes its URL in {files}")
        return Prepared(plan=plan, secret_env=secret)

    async def _submit(self, spec: LaunchSpec, prepared: Prepared, replica_id: str) -> Submission:
        path = self.script_path(spec.name, replica_id)
        endpoint_file = self.endpoint_file(spec.name, replica_id)
        try:
            # A file a previous job left must never be read as this job's address.
            await self.transport.remove_file(endpoint_file)
            await self.transport.write_file(path, prepared.plan.files[path], 0o750)
            result = await self.transport.run(self.submit_argv(path), env=prepared.secret_env,
                                              timeout_s=self.settings.hpc_command_timeout_s)
        except TransportError as exc:
            raise LaunchError(grpc.StatusCode.UNAVAILABLE, "hpc_unreachable", str(exc), "transport") from None
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "submission_refused",
                              f"{result.argv[0]} refused the job: {result.error_line()}", "launcher")
        job_id = self.parse_job_id(result)
        ssh = self.transport.name == "ssh"
        job = reg.HpcJob(
            scheduler=self.scheduler, job_id=job_id, kind="serve", name=spec.name, state="PENDING",
            project=spec.project, partition=spec.partition, nodes=spec.nodes,
            gpus_per_node=spec.gpus_per_node, walltime=spec.walltime, work_dir=self.work_dir(),
            script_path=path, endpoint_file=endpoint_file, transport=self.transport.name,
            ssh_host=self.settings.hpc_ssh_host if ssh else "", submitted_at_ms=time.time_ns() // 1_000_000)
        return Submission(replica_id=replica_id, source=f"{self.scheduler}:{job_id}", job_id=job_id, base_url="",
                          state=reg.ENDPOINT_STATE_PENDING, hpc_job=job,
                          reason=f"{self.scheduler} job {job_id} submitted; waiting for it to publish {endpoint_file}")

    async def start(self, spec: LaunchSpec, prepared: Prepared) -> list[Submission]:
        done: list[Submission] = []
        try:
            for rid in spec.replica_ids:
                done.append(await self._submit(spec, prepared, rid))
        except LaunchError:
            # All or nothing: the jobs already submitted for this start are cancelled.
            for sub in done:
                try:
                    await self.stop(reg.Endpoint(name=spec.name), reg.Replica(id=sub.replica_id, job_id=sub.job_id))
                except LaunchError as undo:
                    log.error("job %s of %s is orphaned: %s", sub.job_id, spec.name, undo)
            raise
        return done

    async def read_endpoint(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        text = await self.transport.read_file(self.endpoint_file(ep.name, replica.id))
        return parse_endpoint_file(text, replica.job_id) if text else ""

    async def status(self, ep: reg.Endpoint, replica: reg.Replica) -> SubstrateView:
        fields = {"scheduler": self.scheduler, "job_id": replica.job_id, "transport": self.transport.describe(),
                  "endpoint_file": self.endpoint_file(ep.name, replica.id)}
        if not replica.job_id:
            return SubstrateView(fields=fields, alive=False, state="NONE", detail="no job on record")
        try:
            state, more = await self.job_state(replica.job_id)
            url = "" if replica.base_url else await self.read_endpoint(ep, replica)
        except TransportError as exc:
            return SubstrateView(fields={**fields, "error": str(exc)}, detail=str(exc))
        fields.update(more)
        fields["job_state"] = state
        alive = state not in self.terminal_states
        detail = f"{self.scheduler} job {replica.job_id} is {state}"
        if more.get("reason") and more["reason"] not in ("None", "(null)"):
            detail += f" ({more['reason']})"
        return SubstrateView(fields=fields, alive=alive, state=state, base_url=url, detail=detail)

    def stop_plan(self, ep: reg.Endpoint, replicas: Sequence[reg.Replica]) -> pb.LaunchPlan:
        commands: list[str] = []
        for r in replicas:
            if r.job_id:
                commands.append(shlex.join(self.cancel_argv(r.job_id)))
            commands.append(f"remove {self.endpoint_file(ep.name, r.id)} ({self.transport.describe()})")
        jobs = ", ".join(r.job_id for r in replicas if r.job_id) or "(none)"
        return pb.LaunchPlan(launcher=self.name, commands=commands, transport=self.transport.describe(),
                             endpoint_file=self.endpoint_file(ep.name, replicas[0].id if replicas else ""),
                             summary=f"cancel {self.scheduler} job {jobs} of endpoint {ep.name!r} and mark it STOPPED")

    async def stop(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        done = "no job to cancel"
        try:
            if replica.job_id:
                result = await self.transport.run(self.cancel_argv(replica.job_id),
                                                  timeout_s=self.settings.hpc_command_timeout_s)
                if result.ok:
                    done = f"job {replica.job_id} cancelled ({result.argv[0]})"
                elif self.already_gone(result):
                    done = f"job {replica.job_id} had already ended"
                else:
                    raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "cancel_refused",
                                      f"{result.argv[0]} {replica.job_id} failed: {result.error_line()}", "job_id")
            await self.transport.remove_file(self.endpoint_file(ep.name, replica.id))
        except TransportError as exc:
            raise LaunchError(grpc.StatusCode.UNAVAILABLE, "hpc_unreachable", str(exc), "transport") from None
        return done

    async def close(self) -> None:
        await self.transport.close()
