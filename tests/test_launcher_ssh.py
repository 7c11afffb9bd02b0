"""The slurm launcher through the SSH transport: a real sshd on 127.0.0.1 as the login node.

The job script is staged over SFTP, sbatch and scancel run over SSH, and the endpoint file comes
back over SFTP, all on one paramiko connection. The API key reaches the job through the
environment (sent on the SSH channel's stdin), never on a command line or in the script.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from examlops_testsupport.fixtures import Stack, free_port
from examlops_testsupport.slurm import (
    ExtraLauncher,
    SlurmCluster,
    SshServer,
    closed_port,
    extra_launcher,
    wait_for,
    write_fake_vllm,
)

SECRET = "sk-ssh-transport-test-9f8e7d"



@pytest.fixture(autouse=True)
def no_job_left_behind(slurm: SlurmCluster) -> Iterator[None]:
    yield
    slurm.cancel_all()

@pytest.fixture(scope="module")
def ssh_launcher(stack: Stack, slurm: SlurmCluster, sshd: SshServer,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraLauncher]:
    root = tmp_path_factory.mktemp("ssh-hpc")
    pack = root / "packs" / "models"
    pack.mkdir(parents=True)
    # A model whose server needs an API key, named by the block and held in the launcher's environment.
    (pack / "fake-keyed.yaml").write_text(
        "engine:\n  engine: vllm\n  hf_model_id: org/keyed-model\n  api_key_secret_ref: env:FAKE_KEYED_API_KEY\n")
    settings = {**sshd.launcher_env(), "EXAMLOPS_VLLM_WORK_DIR": str(root / "work"),
                "EXAMLOPS_VLLM_RUNTIME": "path", "EXAMLOPS_VLLM_BIN": str(write_fake_vllm(root / "bin")),
                "EXAMLOPS_VLLM_JOB_ENV": json.dumps({"EXAMLOPS_FAKE_VLLM_RECORD": str(root / "record.json")}),
                "FAKE_KEYED_API_KEY": SECRET}
    with extra_launcher(stack, root, "launcher-ssh", settings) as launcher:
        launcher.root = root  # type: ignore[attr-defined]
        yield launcher


def test_ssh_stage_submit_discover_stop_with_the_key_by_environment(ssh_launcher: ExtraLauncher, stack: Stack,
                                                                    slurm: SlurmCluster) -> None:
    root: Path = ssh_launcher.root  # type: ignore[attr-defined]
    out = ssh_launcher.cli(stack, "--json", "serve", "llm", "start", "fake-keyed", "--launcher", "slurm",
                           "--gpus", "1", "--port", str(free_port()), "--yes",
                           env={"EXAMLOPS_USECASE_DIR": str(root / "packs")})
    assert out.returncode == 0, out.stderr
    ep = json.loads(out.stdout)
    job = ep["job_id"]
    # Registered at submission; by the time Start returns, the job may already have published.
    assert ep["state"] in ("PENDING", "STARTING", "READY") and job in slurm.queued()
    script = (root / "work" / "fake-keyed.slurm.sh").read_text()   # staged over SFTP
    assert SECRET not in script and ': "${VLLM_API_KEY:?' in script

    wait_for(lambda: ssh_launcher.cli(stack, "serve", "llm", "health", "fake-keyed").returncode == 0, 60, 0.5,
             "READY through the SSH transport")
    listed = json.loads(ssh_launcher.cli(stack, "--json", "serve", "llm", "list").stdout)
    ready = next(e for e in listed if e["name"] == "fake-keyed")
    assert ready["state"] == "READY" and ready["base_url"].startswith("http://")
    record = json.loads((root / "record.json").read_text())
    assert record["api_key_present"] is True and SECRET not in json.dumps(record["argv"])
    jobs = json.loads(ssh_launcher.cli(stack, "--json", "hpc", "jobs", "--name", "fake-keyed").stdout)
    assert jobs[0]["transport"] == "ssh" and jobs[0]["ssh_host"].startswith("root@127.0.0.1:")

    stopped = ssh_launcher.cli(stack, "--json", "serve", "llm", "stop", "fake-keyed", "--yes")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["state"] == "STOPPED"
    wait_for(lambda: job not in slurm.queued(), 30, 0.2, "scancel over SSH")
    assert not (root / "work" / "fake-keyed.endpoint").exists()


def test_unreachable_ssh_host_is_one_clear_error(stack: Stack, tmp_path: Path) -> None:
    port = closed_port()
    settings = {"EXAMLOPS_HPC_TRANSPORT": "ssh", "EXAMLOPS_HPC_SSH_HOST": f"root@127.0.0.1:{port}",
                "EXAMLOPS_HPC_SSH_TIMEOUT_S": "3", "EXAMLOPS_VLLM_WORK_DIR": str(tmp_path / "work")}
    with extra_launcher(stack, tmp_path, "launcher-ssh-down", settings) as launcher:
        out = launcher.cli(stack, "serve", "llm", "start", "fake-ssh-down", "--launcher", "slurm",
                           "--hf-model", "org/m", "--yes")
        assert out.returncode == 1
        assert f"cannot reach the login node root@127.0.0.1:{port} over SSH" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        assert "fake-ssh-down" not in launcher.cli(stack, "serve", "llm", "list").stdout
        events = json.loads(launcher.cli(stack, "--json", "audit", "list", "--target", "endpoint:fake-ssh-down").stdout)
        assert [e["action"] for e in events] == ["start.failed"]
