"""The slurm launcher against a real one-node Slurm on localhost, with a stand-in `vllm` (no model).

Everything here is real but the model server: sbatch/scontrol/scancel on a real cluster, the
rendered job script running as a real job, the endpoint file it publishes, the registry on real
Redis, and the CLI as an operator runs it. The same path with a real CPU vLLM is in
test_launcher_vllm_real.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from examlops_testsupport.fixtures import Stack, free_port
from examlops_testsupport.slurm import ExtraLauncher, SlurmCluster, extra_launcher, wait_for, write_fake_vllm


@pytest.fixture(autouse=True)
def no_job_left_behind(slurm: SlurmCluster) -> Iterator[None]:
    yield
    slurm.cancel_all()

@pytest.fixture(scope="module")
def hpc(stack: Stack, slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraLauncher]:
    """A launcher whose slurm jobs run the stand-in vllm from PATH (EXAMLOPS_VLLM_RUNTIME=path)."""
    root = tmp_path_factory.mktemp("hpc")
    settings = {**slurm.env, "EXAMLOPS_VLLM_WORK_DIR": str(root / "work"), "EXAMLOPS_VLLM_RUNTIME": "path",
                "EXAMLOPS_VLLM_BIN": str(write_fake_vllm(root / "bin")),
                "EXAMLOPS_VLLM_JOB_ENV": json.dumps({"EXAMLOPS_FAKE_VLLM_RECORD": str(root / "record.json")}),
                "EXAMLOPS_USECASE_DIR": str(root / "no-packs")}
    with extra_launcher(stack, root, "launcher-slurm", settings) as launcher:
        launcher.work_dir = root / "work"  # type: ignore[attr-defined]
        launcher.record = root / "record.json"  # type: ignore[attr-defined]
        yield launcher


def endpoint(hpc: ExtraLauncher, stack: Stack, name: str) -> dict[str, object]:
    out = hpc.cli(stack, "--json", "serve", "llm", "list")
    assert out.returncode == 0, out.stderr
    return next(e for e in json.loads(out.stdout) if e["name"] == name)


def start(hpc: ExtraLauncher, stack: Stack, name: str, *extra: str) -> dict[str, object]:
    out = hpc.cli(stack, "--json", "serve", "llm", "start", name, "--launcher", "slurm",
                  "--hf-model", "org/fake-model", "--gpus", "1", "--port", str(free_port()),
                  "--walltime", "00:10:00", "--yes", *extra)
    assert out.returncode == 0, out.stderr
    ep: dict[str, object] = json.loads(out.stdout)
    return ep


def test_start_discover_ready_status_stop_and_restart(hpc: ExtraLauncher, stack: Stack, slurm: SlurmCluster,
                                                      tmp_path: Path) -> None:
    work: Path = hpc.work_dir  # type: ignore[attr-defined]
    ep = start(hpc, stack, "fake-slurm", "--project", "hpc-team")
    job = str(ep["job_id"])
    assert ep["state"] in ("PENDING", "STARTING", "READY")  # the job may have published already
    assert ep["launcher"] == "slurm" and job.isdigit()
    # Registered at submission with no address; the allocation is an HPC job of kind serve.
    jobs = json.loads(hpc.cli(stack, "--json", "hpc", "jobs", "--kind", "serve").stdout)
    record = next(j for j in jobs if j["job_id"] == job)
    assert record["kind"] == "serve" and record["scheduler"] == "slurm" and record["gpus_per_node"] == 1
    trained = json.loads(hpc.cli(stack, "--json", "hpc", "jobs", "--kind", "train").stdout)
    assert all(j["kind"] == "train" for j in trained) and job not in [j["job_id"] for j in trained]
    script = (work / "fake-slurm.slurm.sh").read_text()
    assert "#SBATCH --gpus-per-node=1" in script and "#SBATCH --time=00:10:00" in script

    wait_for(lambda: (work / "fake-slurm.endpoint").is_file(), 60, 0.2, "the endpoint file")
    published = (work / "fake-slurm.endpoint").read_text().splitlines()
    assert published[1] == f"job={job}"
    wait_for(lambda: hpc.cli(stack, "serve", "llm", "health", "fake-slurm").returncode == 0, 60, 0.5, "READY")
    ready = endpoint(hpc, stack, "fake-slurm")
    assert ready["state"] == "READY" and ready["base_url"] == published[0]

    status = json.loads(hpc.cli(stack, "--json", "serve", "llm", "status", "fake-slurm").stdout)
    assert status["substrate"]["job_state"] == "RUNNING" and status["substrate"]["job_id"] == job
    assert status["metrics"]["requests_running"] == 1 and status["metrics"]["kv_cache_usage"] == 0.25
    assert status["metrics"]["ttft_mean_s"] == pytest.approx(0.2)
    argv = json.loads(hpc.record.read_text())["argv"]  # type: ignore[attr-defined]
    assert argv[:2] == ["serve", "org/fake-model"] and "--served-model-name" in argv

    sd = tmp_path / "targets" / "fleet.json"
    assert hpc.cli(stack, "hpc", "prometheus-sd", "--out", str(sd)).returncode == 0
    (target,) = [t for t in json.loads(sd.read_text()) if t["labels"]["endpoint"] == "fake-slurm"]
    assert target["targets"] == [published[0].removeprefix("http://")]
    assert target["labels"]["job_id"] == job and target["labels"]["project"] == "hpc-team"
    assert target["labels"]["scheduler"] == "slurm" and target["labels"]["gpus_per_node"] == "1"

    dry = hpc.cli(stack, "serve", "llm", "stop", "fake-slurm", "--dry-run")
    assert dry.returncode == 0 and f"scancel {job}" in dry.stdout and job in slurm.queued()
    stopped = hpc.cli(stack, "--json", "serve", "llm", "stop", "fake-slurm", "--yes")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["state"] == "STOPPED" and json.loads(stopped.stdout)["base_url"] == ""
    wait_for(lambda: job not in slurm.queued(), 30, 0.2, "the job gone from the queue")
    assert slurm.job_state(job) in ("CANCELLED", "GONE")
    assert not (work / "fake-slurm.endpoint").exists()
    events = json.loads(hpc.cli(stack, "--json", "audit", "list", "--target", "endpoint:fake-slurm").stdout)
    assert events[0]["action"] == "stop" and "register" in [e["action"] for e in events]
    # Registered at submission with the job id and no address; the address came by discovery.
    registered = json.loads(next(e for e in events if e["action"] == "register")["after_json"])
    assert registered["job_id"] == job and not registered.get("base_url")
    assert registered["state"] == "ENDPOINT_STATE_PENDING"
    assert any(e["action"] == "discover" for e in events)
    jobs = json.loads(hpc.cli(stack, "--json", "hpc", "jobs", "--name", "fake-slurm").stdout)
    assert next(j for j in jobs if j["job_id"] == job)["state"] == "CANCELLED"

    # A restart never inherits the old address, even from an endpoint file the old job left.
    (work / "fake-slurm.endpoint").write_text(f"{published[0]}\njob={job}\n")
    again = start(hpc, stack, "fake-slurm")
    assert again["job_id"] != job and again["base_url"] != published[0]
    assert not (work / "fake-slurm.endpoint").exists() or f"job={again['job_id']}" in (
        work / "fake-slurm.endpoint").read_text()
    wait_for(lambda: hpc.cli(stack, "serve", "llm", "health", "fake-slurm").returncode == 0, 60, 0.5, "READY again")
    fresh = (work / "fake-slurm.endpoint").read_text().splitlines()
    assert fresh[1] == f"job={again['job_id']}" and endpoint(hpc, stack, "fake-slurm")["base_url"] == fresh[0]
    assert hpc.cli(stack, "serve", "llm", "stop", "fake-slurm", "--yes").returncode == 0
    wait_for(lambda: str(again["job_id"]) not in slurm.queued(), 30, 0.2, "the second job gone")


def test_dry_run_prints_the_job_script_and_submits_nothing(hpc: ExtraLauncher, stack: Stack,
                                                           slurm: SlurmCluster) -> None:
    before = slurm.queued()
    out = hpc.cli(stack, "serve", "llm", "start", "fake-dry", "--launcher", "slurm", "--hf-model", "org/m",
                  "--nodes", "2", "--gpus", "4", "--tp", "4", "--pp", "2", "--partition", "gpu",
                  "--walltime", "04:00:00", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=2" in out.stdout and "#SBATCH --gpus-per-node=4" in out.stdout
    assert "ray start --head" in out.stdout and "sbatch --parsable" in out.stdout
    assert slurm.queued() == before
    assert "fake-dry" not in hpc.cli(stack, "serve", "llm", "list").stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["--launcher", "nomad", "--hf-model", "org/m"], "unknown launcher 'nomad'"),
    (["--launcher", "slurm"], "needs the weights to serve: pass --hf-model"),
    (["--launcher", "slurm", "--hf-model", "org/m", "--gpus", "2"],
     "sbatch refused the job: sbatch: error: Batch job submission failed: Requested node configuration is not"),
    (["--launcher", "slurm", "--hf-model", "org/m", "--partition", "nope"], "sbatch refused the job"),
    (["--launcher", "slurm", "--hf-model", "org/m", "--tp", "2", "--gpus", "1"], "2 GPU workers"),
    (["--launcher", "slurm", "--hf-model", "org/m"], "cancelled (pass --yes"),
])
def test_operator_errors_are_one_line_and_leave_no_record(hpc: ExtraLauncher, stack: Stack, slurm: SlurmCluster,
                                                          args: list[str], expected: str) -> None:
    before = slurm.queued()
    yes = [] if "cancelled" in expected else ["--yes"]
    out = hpc.cli(stack, "serve", "llm", "start", "fake-refused", *args, *yes)
    assert out.returncode == 1, out.stdout
    assert expected in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "fake-refused" not in hpc.cli(stack, "serve", "llm", "list").stdout
    assert slurm.queued() == before
    if "refused the job" in expected:
        events = json.loads(hpc.cli(stack, "--json", "audit", "list", "--target", "endpoint:fake-refused",
                                    "--action", "start.failed").stdout)
        assert events and "submission_refused" in events[0]["after_json"]


def test_restart_with_replace_cancels_the_running_job(hpc: ExtraLauncher, stack: Stack, slurm: SlurmCluster) -> None:
    first = start(hpc, stack, "fake-replace")
    refused = hpc.cli(stack, "serve", "llm", "start", "fake-replace", "--launcher", "slurm", "--hf-model", "org/m",
                      "--gpus", "1", "--yes")
    assert refused.returncode == 1 and "--replace" in refused.stderr
    second = start(hpc, stack, "fake-replace", "--replace")
    assert second["job_id"] != first["job_id"]
    wait_for(lambda: str(first["job_id"]) not in slurm.queued(), 30, 0.2, "the replaced job gone")
    assert hpc.cli(stack, "serve", "llm", "stop", "fake-replace", "--yes").returncode == 0
    wait_for(lambda: str(second["job_id"]) not in slurm.queued(), 30, 0.2, "the job gone")


@pytest.mark.timeout(420)
def test_endpoint_file_never_appearing_within_the_walltime(stack: Stack, slurm: SlurmCluster, tmp_path: Path) -> None:
    """An image pull slower than the walltime: the job is killed before its head publishes an address."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in `apptainer` whose pull never finishes (the real one would download gigabytes).
    (bin_dir / "apptainer").write_text("#!/bin/sh\nexec sleep 3600\n")
    (bin_dir / "apptainer").chmod(0o755)
    import os

    settings = {**slurm.env, "EXAMLOPS_VLLM_WORK_DIR": str(tmp_path / "work"), "EXAMLOPS_VLLM_RUNTIME": "apptainer",
                "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with extra_launcher(stack, tmp_path, "launcher-walltime", settings) as launcher:
        out = launcher.cli(stack, "--json", "serve", "llm", "start", "fake-walltime", "--launcher", "slurm",
                           "--hf-model", "org/huge-model", "--walltime", "00:01:00", "--yes")
        assert out.returncode == 0, out.stderr
        job = json.loads(out.stdout)["job_id"]
        pending = launcher.cli(stack, "serve", "llm", "health", "fake-walltime")
        assert pending.returncode == 1 and "waiting for it to publish" in pending.stdout
        wait_for(lambda: job not in slurm.queued(), 240, 2, "Slurm ending the job at its walltime")
        health = launcher.cli(stack, "serve", "llm", "health", "fake-walltime")
        assert health.returncode == 1
        assert "TIMEOUT" in health.stdout and "without publishing its address" in health.stdout
        assert "within its walltime" in health.stdout and "fake-walltime.endpoint" in health.stdout
        listed = json.loads(launcher.cli(stack, "--json", "serve", "llm", "list").stdout)
        assert next(e for e in listed if e["name"] == "fake-walltime")["state"] == "FAILED"
        jobs = json.loads(launcher.cli(stack, "--json", "hpc", "jobs", "--name", "fake-walltime").stdout)
        assert jobs[0]["state"] == "TIMEOUT"
    shutil.rmtree(tmp_path / "work", ignore_errors=True)


def test_chat_reads_the_endpoint_file_first(hpc: ExtraLauncher, stack: Stack, slurm: SlurmCluster) -> None:
    work: Path = hpc.work_dir  # type: ignore[attr-defined]
    ep = start(hpc, stack, "fake-chat")
    wait_for(lambda: (work / "fake-chat.endpoint").is_file(), 60, 0.2, "the endpoint file")
    assert endpoint(hpc, stack, "fake-chat")["base_url"] == ""
    # The stand-in server cannot chat; what matters is that the address was learned on the way.
    hpc.cli(stack, "serve", "llm", "chat", "fake-chat", "-m", "hello")
    assert endpoint(hpc, stack, "fake-chat")["base_url"] == (work / "fake-chat.endpoint").read_text().splitlines()[0]
    assert hpc.cli(stack, "serve", "llm", "stop", "fake-chat", "--yes").returncode == 0
    wait_for(lambda: str(ep["job_id"]) not in slurm.queued(), 30, 0.2, "the job gone")
