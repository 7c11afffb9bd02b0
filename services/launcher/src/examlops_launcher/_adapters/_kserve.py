"""kserve: emit an LLMInferenceService whose container argv comes from the renderer. Never applied.

TP/PP go into `spec.parallelism`, GPUs into the containers' resources, and a multi-node block
gets a `worker` pod template. When a cluster answers, `kubectl apply --dry-run=server` checks
the manifest against the real CRD and admission; the launcher never applies it (apply and
delete it with kubectl). EXAMLOPS_KSERVE_LIVE_APPLY=1 only records the endpoint as STARTING
instead of PENDING.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

import grpc
import yaml

from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg
from examlops.yamlio import dump_yaml

from .._settings import LauncherSettings
from .._transport import LocalTransport, TransportError
from ._base import Adapter, LaunchError, LaunchSpec, Prepared, Submission, SubstrateView, redacted, render, split_env

CONTAINER_PORT = 8000
GPU_RESOURCE = "nvidia.com/gpu"
#: uid/gid of the serving pods: never root (the stack's own pods use 10001 too).
POD_UID = 10001


#: Where KServe mounts the files of a model URI it downloaded.
MODEL_MOUNT = "/mnt/models"

def secret_name(endpoint: str) -> str:
    """The Kubernetes Secret holding an endpoint's API key (key VLLM_API_KEY)."""
    return re.sub(r"[^a-z0-9-]", "-", f"{endpoint}-vllm-api-key")


def _container(name: str, image: str, resources: dict[str, Any], env: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name, "image": image, "env": env,
        "resources": resources,
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "home", "mountPath": "/home"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "model-cache", "mountPath": "/models"}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _pod(containers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": POD_UID, "runAsGroup": POD_UID, "fsGroup": POD_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
        "volumes": [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                    {"name": "model-cache", "emptyDir": {}},
                    # PagedAttention needs far more shared memory than the container default.
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}],
    }


class KServeAdapter(Adapter):
    name = "kserve"

    def __init__(self, settings: LauncherSettings) -> None:
        super().__init__(settings)
        self.local = LocalTransport()

    def manifest_path(self, name: str) -> str:
        return f"{self.settings.vllm_work_dir.rstrip('/')}/{name}.llmisvc.yaml"

    def manifest(self, spec: LaunchSpec) -> dict[str, Any]:
        assert spec.block is not None
        block = spec.block
        var = block.api_key_env_var
        # The key's value is never in a manifest: the pod reads it from a Secret.
        command = render(spec, host=None, port=CONTAINER_PORT, environ={var: "secret"} if var else {})
        plain, secret = split_env(command.env)
        env: list[dict[str, Any]] = [{"name": "HOME", "value": "/home"}, {"name": "HF_HOME", "value": "/models"}]
        env += [{"name": k, "value": v} for k, v in plain.items()]
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name(spec.name), "key": k}}}
                for k in sorted(secret)]
        gpus = spec.gpus_per_node or max(1, -(-spec.tp * spec.pp // max(spec.nodes, 1)))
        amounts = {"cpu": self.settings.kserve_cpu, "memory": self.settings.kserve_memory, GPU_RESOURCE: str(gpus)}
        resources = {"requests": dict(amounts), "limits": dict(amounts)}
        image = self.settings.vllm_image.split("://", 1)[-1]
        main = _container("main", image, resources, env)
        args = command.argv[3:]
        if spec.nodes > 1 and "--distributed-executor-backend" not in args:
            args += ["--distributed-executor-backend", "ray"]
        head = command.argv[:3]
        if spec.model_version:
            head[2] = MODEL_MOUNT  # KServe's storage initializer puts the version's files there
        main.update(command=head, args=args,
                    ports=[{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}])
        probe = {"httpGet": {"path": "/health", "port": CONTAINER_PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
        main["startupProbe"] = {**probe, "failureThreshold": 60}     # up to 10 minutes to load the weights
        main["readinessProbe"] = {**probe, "failureThreshold": 3}
        main["livenessProbe"] = {**probe, "failureThreshold": 3}
        metadata: dict[str, Any] = {"name": spec.name, "labels": {
            "app.kubernetes.io/managed-by": "examlops", "examlops.io/endpoint": spec.name}}
        if spec.project:
            metadata["labels"]["examlops.io/project"] = spec.project
        if spec.model_version:
            metadata["annotations"] = {"examlops.io/model-version": spec.model_version}
        if self.settings.kserve_namespace:
            metadata["namespace"] = self.settings.kserve_namespace
        body: dict[str, Any] = {
            "model": {"uri": self.model_uri(spec), "name": block.served_model_name or spec.name},
            "replicas": len(spec.replica_ids),
            "parallelism": {"tensor": spec.tp, "pipeline": spec.pp},
            "template": _pod([main]),
        }
        if spec.nodes > 1:
            # One worker pod per further node; KServe forms the Ray cluster over head and workers.
            body["worker"] = _pod([_container("main", image, resources, env)])
        return {"apiVersion": self.settings.kserve_api_version, "kind": "LLMInferenceService",
                "metadata": metadata, "spec": body}

    def model_uri(self, spec: LaunchSpec) -> str:
        """hf://<id> for a Hub model; a registered version from the cluster's model store."""
        assert spec.block is not None and spec.block.hf_model_id is not None
        if spec.model_version:
            name, _, version = spec.model_version.partition("@")
            return f"{self.settings.kserve_model_store.rstrip('/')}/{name}/{version}"
        return f"hf://{spec.block.hf_model_id}"

    def plan(self, spec: LaunchSpec) -> Prepared:
        manifest = self.manifest(spec)
        text = dump_yaml(manifest)
        path = self.manifest_path(spec.name)
        main = manifest["spec"]["template"]["containers"][0]
        return Prepared(plan=pb.LaunchPlan(
            launcher=self.name, argv=[*main["command"], *main["args"]], manifest=text, files={path: text},
            env=redacted({e["name"]: e.get("value", "***") for e in main["env"]}),
            commands=[f"write {path}", f"{self.settings.kubectl} apply --dry-run=server -f {path}  "
                      "(only when a cluster answers; the launcher never applies)"],
            summary=(f"emit the LLMInferenceService {spec.name!r} ({len(spec.replica_ids)} replica(s) of "
                     f"{spec.nodes} node(s), tp {spec.tp}, "
                     f"pp {spec.pp}) to {path}; it is NOT applied: kubectl apply -f {path}")))

    async def _server_dry_run(self, path: str) -> str:
        kubectl = shlex.split(self.settings.kubectl)
        ready = await self.local.run([*kubectl, "get", "--raw", "/readyz", "--request-timeout=5s"], timeout_s=15)
        if not ready.ok:
            return "not validated by a cluster (none reachable)"
        result = await self.local.run([*kubectl, "apply", "--dry-run=server", "-f", path,
                                       "--request-timeout=30s"], timeout_s=60)
        if not result.ok:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "manifest_rejected",
                              f"the cluster rejects the LLMInferenceService: {result.error_line()}", "manifest")
        return "accepted by kubectl apply --dry-run=server"

    async def write(self, spec: LaunchSpec, prepared: Prepared) -> str:
        """Write the manifest and have a cluster check it when one answers; what was checked."""
        path = self.manifest_path(spec.name)
        await self.write_text(path, prepared.plan.manifest)
        return f"manifest {path} {await self._server_dry_run(path)}"

    async def start(self, spec: LaunchSpec, prepared: Prepared) -> list[Submission]:
        # KServe spreads spec.replicas pods behind one service URL: one replica record for the URL.
        checked = await self.write(spec, prepared)
        live = self.settings.kserve_live_apply
        path = self.manifest_path(spec.name)
        return [Submission(
            replica_id=spec.replica_ids[0], source=f"kserve:{spec.name}", job_id=f"llminferenceservice/{spec.name}",
            base_url="", state=reg.ENDPOINT_STATE_STARTING if live else reg.ENDPOINT_STATE_PENDING,
            reason=f"{checked}; never applied by the launcher: kubectl apply -f {path}")]

    async def rescale(self, name: str, replicas: int, write: bool) -> pb.LaunchPlan:
        """The emitted manifest with spec.replicas changed (written unless a dry run); never applied."""
        path = self.manifest_path(name)
        try:
            manifest = yaml.safe_load(await self.local.read_file(path) or "null")
        except (TransportError, yaml.YAMLError) as exc:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "manifest_unreadable", str(exc),
                              "manifest") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("spec"), dict):
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "manifest_missing",
                              f"no LLMInferenceService manifest at {path}: start it again with "
                              f"exa serve llm start {name} --launcher kserve --replicas {replicas} --replace",
                              "manifest")
        before = manifest["spec"].get("replicas", 1)
        manifest["spec"]["replicas"] = replicas
        text = dump_yaml(manifest)
        if write:
            await self.write_text(path, text)
        return pb.LaunchPlan(launcher=self.name, manifest=text, files={path: text}, commands=[f"write {path}"],
                             summary=(f"spec.replicas {before} -> {replicas} in {path}; never applied by the "
                                      f"launcher: kubectl apply -f {path}"))

    async def write_text(self, path: str, text: str) -> None:
        try:
            await self.local.write_file(path, text)
        except TransportError as exc:
            raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "manifest_unwritable", str(exc),
                              "manifest") from None

    async def status(self, ep: reg.Endpoint, replica: reg.Replica) -> SubstrateView:
        return SubstrateView(fields={"manifest": self.manifest_path(ep.name), "applied_by_launcher": "never",
                                     "live_apply_setting": str(self.settings.kserve_live_apply).lower()})

    def stop_plan(self, ep: reg.Endpoint, replicas: Sequence[reg.Replica]) -> pb.LaunchPlan:
        path = self.manifest_path(ep.name)
        return pb.LaunchPlan(launcher=self.name, summary=(
            f"mark {ep.name!r} STOPPED; the launcher never applied {path}: delete it with kubectl delete -f {path}"))

    async def stop(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        return f"stopped by operator; if you applied it: kubectl delete -f {self.manifest_path(ep.name)}"
