"""compose: the `vllm` service of the stack's compose.yaml, on this host's GPU.

The rendered argv reaches the service through a small override file (its `command:` replaces
the base file's), and EXAMLOPS_VLLM_MODEL is set for the compose command, as the raw form
`EXAMLOPS_VLLM_MODEL=... docker compose --profile vllm up -d vllm` does. The API key is passed
through from the compose command's environment by name; its value is never written to a file.
"""

from __future__ import annotations

import json
import shlex

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

    def plan(self, spec: LaunchSpec) -> Prepared:
        command = render(spec, host="0.0.0.0", port=CONTAINER_PORT)
        plain, secret = split_env(command.env)
        model = command.argv[2]
        environment: dict[str, str | None] = {**plain, **{k: None for k in sorted(secret)}}
        override = {"services": {SERVICE: {"command": command.argv[2:], "environment": environment}}}
        text = (f"# Rendered by the ExaMLOps launcher for endpoint {spec.name}: the vllm service's argv.\n"
                "# A variable without a value (the API key) is taken from the compose command's environment.\n"
                + dump_yaml(override))
        path = self.override_path(spec.name)
        env = {"EXAMLOPS_VLLM_MODEL": model}
        up = self.compose_argv(path, "up", "-d", SERVICE)
        plan = pb.LaunchPlan(
            launcher=self.name, argv=command.argv, env=redacted({**env, **command.env}), files={path: text},
            commands=[f"write {path}", shell_line(up, env)],
            summary=(f"start the compose service {SERVICE!r} serving {model} as {spec.name!r} at "
                     f"{self.settings.compose_base_url}"))
        return Prepared(plan=plan, secret_env=secret, env=env)

    async def start(self, spec: LaunchSpec, prepared: Prepared) -> Submission:
        (path, text), = prepared.plan.files.items()
        try:
            await self.local.write_file(path, text)
        except TransportError as exc:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed", str(exc), "compose") from None
        result = await self.local.run(self.compose_argv(path, "up", "-d", SERVICE),
                                      env={**prepared.env, **prepared.secret_env},
                                      timeout_s=max(self.settings.hpc_command_timeout_s, 300))
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed",
                              f"docker compose could not start the {SERVICE} service: {result.error_line()}",
                              "compose")
        return Submission(job_id=f"compose:{SERVICE}", base_url=self.settings.compose_base_url,
                          state=reg.ENDPOINT_STATE_STARTING,
                          reason=f"compose service {SERVICE} started; loading the model")

    async def status(self, ep: reg.Endpoint) -> SubstrateView:
        fields = {"compose_file": self.settings.compose_file, "service": SERVICE}
        result = await self.local.run(self.compose_argv(None, "ps", "--all", "--format", "json", SERVICE))
        if not result.ok:
            return SubstrateView(fields={**fields, "error": result.error_line()}, detail=result.error_line())
        rows = []
        for line in result.stdout.strip().splitlines():
            parsed = json.loads(line)
            rows += parsed if isinstance(parsed, list) else [parsed]
        if not rows:
            return SubstrateView(fields={**fields, "container_state": "absent"}, alive=False, state="absent",
                                 detail=f"no {SERVICE} container")
        row = rows[0]
        state = str(row.get("State", "unknown"))
        fields.update(container=str(row.get("Name", "")), container_state=state,
                      container_health=str(row.get("Health", "")), container_status=str(row.get("Status", "")))
        return SubstrateView(fields=fields, alive=state in ("running", "restarting", "created"), state=state,
                             detail=f"container {row.get('Name', SERVICE)} is {state}")

    def stop_plan(self, ep: reg.Endpoint) -> pb.LaunchPlan:
        return pb.LaunchPlan(launcher=self.name, commands=[shlex.join(self.compose_argv(None, "stop", SERVICE))],
                             summary=f"stop the compose service {SERVICE!r} and mark {ep.name!r} STOPPED")

    async def stop(self, ep: reg.Endpoint) -> str:
        result = await self.local.run(self.compose_argv(None, "stop", SERVICE),
                                      timeout_s=max(self.settings.hpc_command_timeout_s, 120))
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "compose_failed",
                              f"docker compose could not stop the {SERVICE} service: {result.error_line()}",
                              "compose")
        await self.local.remove_file(self.override_path(ep.name))
        return f"compose service {SERVICE} stopped"
