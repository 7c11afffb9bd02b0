"""compose: the `vllm` service of the stack's compose.yaml, on this host's GPU.

The rendered argv reaches the service through a small override file (its `command:` replaces
the base file's), and EXAMLOPS_VLLM_MODEL is set for the compose command, as the raw form
`EXAMLOPS_VLLM_MODEL=... docker compose --profile vllm up -d vllm` does. The API key is passed
through from the compose command's environment by name; its value is never written to a file.

A pool of N is the service scaled (`up -d --scale vllm=N`): the override then replaces the base
file's one host port with a range, container #i answering on compose_base_url's port + i - 1
(`docker compose ps` tells the port it really got). Compose removes the highest-numbered
container first, so only the newest compose replica can be removed on its own.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import grpc

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg
from examlops.yamlio import dump_yaml

from .._settings import LauncherSettings
from .._transport import LocalTransport, TransportError
from ._base import (
    Adapter,
    LaunchError,
    LaunchSpec,
    Prepared,
    Submission,
    SubstrateView,
    redacted,
    render,
    shell_line,
    split_env,
)

SERVICE = "vllm"
CONTAINER_PORT = 8000


class ComposeAdapter(Adapter):
    name = "compose"
    #: The stack has ONE vllm service: a second compose endpoint would replace the first's server.
    exclusive = True

    def __init__(self, settings: LauncherSettings) -> None:
        super().__init__(settings)
        self.local = LocalTransport()

    def override_path(self, name: str) -> str:
        return f"{self.settings.vllm_work_dir.rstrip('/')}/{name}.compose.override.yaml"

    def compose_argv(self, override: str | None, *args: str) -> list[str]:
        argv = [*shlex.split(self.settings.compose_command), "-f", self.settings.compose_file]
        if override:
            argv += ["-f", override]
        return [*argv, "--profile", SERVICE, *args]

    def host_port(self, index: int) -> tuple[str, int]:
        """(host, port) where container #index (1-based) publishes: compose_base_url's port + index - 1."""
        parts = urlsplit(self.settings.compose_base_url)
        return parts.hostname or "127.0.0.1", (parts.port or CONTAINER_PORT) + index - 1

    def base_url(self, index: int) -> str:
        host, port = self.host_port(index)
        return f"{urlsplit(self.settings.compose_base_url).scheme or 'http'}://{host}:{port}"

    def plan(self, spec: LaunchSpec) -> Prepared:
        command = render(spec, host="0.0.0.0", port=CONTAINER_PORT)
        plain, secret = split_env(command.env)
        model = command.argv[2]
        environment: dict[str, str | None] = {**plain, **{k: None for k in sorted(secret)}}
        override = {"services": {SERVICE: {"command": command.argv[2:], "environment": environment}}}
        text = (f"# Rendered by the ExaMLOps launcher for endpoint {spec.name}: the vllm service's argv.\n"
                "# A variable without a value (the API key) is taken from the compose command's environment.\n"
                + dump_yaml(override))
        total = spec.first_index + len(spec.replica_ids)
        if total > 1:
            # One host port per container: the base file's single port would collide at the second.
            host, first = self.host_port(1)
            text += f"    ports: !override\n      - \"{host}:{first}-{first + total - 1}:{CONTAINER_PORT}\"\n"
        path = self.override_path(spec.name)
        env = {"EXAMLOPS_VLLM_MODEL": model}
        up = self.compose_argv(path, *self.up_args(total, recreate=not spec.first_index))
        where = ", ".join(self.base_url(i) for i in self.indices(spec))
        plan = pb.LaunchPlan(
            launcher=self.name, argv=command.argv, env=redacted({**env, **command.env}), files={path: text},
            commands=[f"write {path}", shell_line(up, env)],
            summary=(f"start the compose service {SERVICE!r} serving {model} as {spec.name!r} at {where}"
                     + (f" ({total} containers)" if total > 1 else "")))
        return Prepared(plan=plan, secret_env=secret, env=env)

    @staticmethod
    def up_args(total: int, recreate: bool = True) -> list[str]:
        if total == 1 and recreate:
            return ["up", "-d", SERVICE]
        # Scaling a live pool must not restart the containers that already serve.
        return ["up", "-d", *([] if recreate else ["--no-recreate"]), "--scale", f"{SERVICE}={total}", SERVICE]

    @staticmethod
    def indices(spec: LaunchSpec) -> range:
        return range(spec.first_index + 1, spec.first_index + len(spec.replica_ids) + 1)

    async def start(self, spec: LaunchSpec, prepared: Prepared) -> list[Submission]:
        (path, text), = prepared.plan.files.items()
        try:
            await self.local.write_file(path, text)
        except TransportError as exc:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed", str(exc), "compose") from None
        total = spec.first_index + len(spec.replica_ids)
        result = await self.local.run(self.compose_argv(path, *self.up_args(total, recreate=not spec.first_index)),
                                      env={**prepared.env, **prepared.secret_env},
                                      timeout_s=max(self.settings.hpc_command_timeout_s, 300))
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed",
                              f"docker compose could not start the {SERVICE} service: {result.error_line()}",
                              "compose")
        return [Submission(replica_id=rid, source=f"compose:{SERVICE}#{i}", job_id=f"compose:{SERVICE}#{i}",
                           base_url=self.base_url(i), state=reg.ENDPOINT_STATE_STARTING,
                           reason=f"compose service {SERVICE} container #{i} started; loading the model")
                for rid, i in zip(spec.replica_ids, self.indices(spec), strict=True)]

    async def status(self, ep: reg.Endpoint, replica: reg.Replica) -> SubstrateView:
        fields = {"compose_file": self.settings.compose_file, "service": SERVICE}
        result = await self.local.run(self.compose_argv(None, "ps", "--all", "--format", "json", SERVICE))
        if not result.ok:
            return SubstrateView(fields={**fields, "error": result.error_line()}, detail=result.error_line())
        rows = []
        for line in result.stdout.strip().splitlines():
            parsed = json.loads(line)
            rows += parsed if isinstance(parsed, list) else [parsed]
        index = container_index(replica.source)
        row = next((r for r in rows if row_index(r) == index), None)
        if row is None:
            return SubstrateView(fields={**fields, "container_state": "absent"}, alive=False, state="absent",
                                 detail=f"no {SERVICE} container #{index}")
        state = str(row.get("State", "unknown"))
        fields.update(container=str(row.get("Name", "")), container_state=state,
                      container_health=str(row.get("Health", "")), container_status=str(row.get("Status", "")))
        published = next((p.get("PublishedPort") for p in row.get("Publishers") or []
                          if p.get("TargetPort") == CONTAINER_PORT and p.get("PublishedPort")), None)
        url = f"http://{self.host_port(1)[0]}:{published}" if published else ""
        return SubstrateView(fields=fields, alive=state in ("running", "restarting", "created"), state=state,
                             base_url=url, detail=f"container {row.get('Name', SERVICE)} is {state}")

    def _scale_down(self, ep: reg.Endpoint, replica: reg.Replica) -> list[str]:
        """The command that removes this replica's container: compose removes the highest numbers first."""
        numbers = sorted(container_index(r.source) for r in ep.replicas if r.source.startswith("compose:"))
        index = container_index(replica.source)
        if numbers and index != numbers[-1]:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_scales_from_the_top",
                              f"docker compose removes the highest-numbered container first: remove "
                              f"compose:{SERVICE}#{numbers[-1]} before #{index} (or scale down)", "replica")
        if index <= 1:
            return self.compose_argv(None, "stop", SERVICE)
        return self.compose_argv(self.override_path(ep.name), *self.up_args(index - 1, recreate=False))

    def stop_plan(self, ep: reg.Endpoint, replicas: Sequence[reg.Replica]) -> pb.LaunchPlan:
        if len(replicas) == 1 and len(ep.replicas) > 1:
            return pb.LaunchPlan(launcher=self.name, commands=[shlex.join(self._scale_down(ep, replicas[0]))],
                                 summary=f"remove container {replicas[0].source} of {ep.name!r}")
        return pb.LaunchPlan(launcher=self.name, commands=[shlex.join(self.compose_argv(None, "stop", SERVICE))],
                             summary=f"stop the compose service {SERVICE!r} and mark {ep.name!r} STOPPED")

    async def _run(self, argv: list[str], what: str) -> None:
        result = await self.local.run(argv, timeout_s=max(self.settings.hpc_command_timeout_s, 120))
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed",
                              f"docker compose could not {what}: {result.error_line()}", "compose")

    async def stop(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        argv = self._scale_down(ep, replica)
        if "stop" in argv:
            return await self.stop_all(ep)
        await self._run(argv, f"remove {replica.source}")
        return f"container {replica.source} removed"

    async def stop_all(self, ep: reg.Endpoint) -> str:
        await self._run(self.compose_argv(None, "stop", SERVICE), f"stop the {SERVICE} service")
        await self.local.remove_file(self.override_path(ep.name))
        return f"compose service {SERVICE} stopped"


def container_index(source: str) -> int:
    """compose:vllm#2 -> 2; a record from before pools is container 1."""
    _, _, number = source.rpartition("#")
    return int(number) if number.isdigit() else 1


def row_index(row: dict[str, Any]) -> int:
    """The container number of a `docker compose ps --format json` row."""
    labels = dict(part.split("=", 1) for part in str(row.get("Labels", "")).split(",") if "=" in part)
    number = labels.get("com.docker.compose.container-number") or str(row.get("Name", "")).rpartition("-")[2]
    return int(number) if number.isdigit() else 1
