from __future__ import annotations

from typing import Literal

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, GrpcServiceSettings


class LauncherSettings(GrpcServiceSettings):
    """Launcher settings (`EXAMLOPS_*`).

    The launcher name of a start picks the scheduler (slurm → sbatch, flux → flux batch);
    EXAMLOPS_HPC_SCHEDULER governs training jobs only and is deliberately not read here.
    """

    port: int = Field(default=DEFAULT_PORTS["launcher"], ge=0, le=65535, description="gRPC port of the launcher.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}", description="Registry gRPC address.")
    probe_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one health probe of a server.")

    # --- HPC (slurm, flux) ---
    vllm_image: str = Field(default="docker://vllm/vllm-openai:latest",
                            description="Container image Apptainer pulls (once) for HPC jobs.")
    vllm_work_dir: str = Field(
        default="/tmp/examlops-vllm",
        description="Job scripts, the SIF cache and endpoint files; the SAME path on the launcher's side and "
                    "on the compute nodes (a filesystem they share with the login node).")
    vllm_modules: str = Field(default="", description="Comma-separated `module load` names for HPC jobs.")
    vllm_runtime: Literal["apptainer", "path"] = Field(
        default="apptainer",
        description="apptainer: run vLLM from the pulled image; path: run EXAMLOPS_VLLM_BIN from the node's PATH "
                    "(sites without Apptainer, and the tests).")
    vllm_bin: str = Field(default="vllm", description="The `vllm` program of the path runtime (name or path).")
    vllm_job_env: dict[str, str] = Field(
        default_factory=dict,
        description='Non-secret environment exported in every job script, as JSON: {"HF_HOME": "/shared/hf"}.')
    hpc_transport: Literal["local", "ssh"] = Field(
        default="local", description="local: sbatch/flux run here; ssh: on EXAMLOPS_HPC_SSH_HOST.")
    hpc_ssh_host: str = Field(default="", description="Login node for the ssh transport: [user@]host[:port].")
    hpc_ssh_key_file: str = Field(default="", description="Private key for the login node (default: ssh agent/keys).")
    hpc_ssh_known_hosts: str = Field(
        default="", description="known_hosts file holding the login node's host key (besides ~/.ssh/known_hosts).")
    hpc_ssh_timeout_s: float = Field(default=10.0, gt=0, description="SSH connect timeout.")
    hpc_account: str = Field(default="", description="Scheduler account (#SBATCH --account) for serving jobs.")
    hpc_command_timeout_s: float = Field(default=60.0, gt=0, description="Timeout of one scheduler command.")
    ray_port: int = Field(default=6379, ge=1, le=65535, description="Port of the Ray head in multi-node jobs.")

    # --- compose ---
    compose_command: str = Field(default="docker compose", description="The Docker Compose command.")
    compose_file: str = Field(default="compose.yaml", description="The stack's compose file (has the vllm service).")
    compose_base_url: str = Field(default="http://127.0.0.1:8000",
                                  description="Where the compose vllm service answers, seen from the launcher.")

    # --- kserve ---
    kserve_namespace: str = Field(default="", description="Namespace of emitted LLMInferenceServices (empty: none).")
    kserve_api_version: str = Field(default="serving.kserve.io/v1alpha2",
                                    description="apiVersion of emitted LLMInferenceServices.")
    kserve_live_apply: bool = Field(
        default=False, description="Record kserve endpoints as STARTING instead of PENDING (nothing is applied).")
    kserve_model_store: str = Field(
        default="pvc://examlops-models",
        description="Where a cluster finds registered model versions: NAME@V is served from <store>/NAME/V "
                    "(a PVC or bucket holding each version's files, as registered).")
    kserve_cpu: str = Field(default="8", description="CPU request and limit of each serving pod.")
    kserve_memory: str = Field(default="64Gi", description="Memory request and limit of each serving pod.")
    kubectl: str = Field(default="kubectl", description="kubectl for `apply --dry-run=server` when a cluster answers.")

    @property
    def modules(self) -> list[str]:
        return [m.strip() for m in self.vllm_modules.split(",") if m.strip()]
