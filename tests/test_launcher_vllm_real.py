"""A real CPU vLLM started as a real Slurm job, locally and through the SSH transport.

`exa serve llm start --launcher slurm` submits the rendered job script; the job runs `vllm
serve` from the CPU vLLM venv (EXAMLOPS_VLLM_RUNTIME=path) on the SmolLM2 folder, publishes its
endpoint file, health turns READY, a chat through the gateway answers, stop cancels the job and
a restart never inherits the old address. One vLLM at a time (2 cores): each test stops its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.slurm import ExtraLauncher, SlurmCluster, SshServer, extra_launcher, wait_for
from examlops_testsupport.vllm import launcher_settings, write_pack

pytestmark = pytest.mark.vllm
LOAD_TIMEOUT_S = 600


def start(launcher: ExtraLauncher, stack: Stack, root: Path, name: str) -> dict[str, object]:
    out = launcher.cli(stack, "--json", "serve", "llm", "start", name, "--launcher", "slurm", "--gpus", "1",
                       "--port", str(free_port()), "--walltime", "00:30:00", "--yes",
                       env={"EXAMLOPS_USECASE_DIR": str(root / "packs")})
    assert out.returncode == 0, out.stderr
    ep: dict[str, object] = json.loads(out.stdout)
    # Registered with no address; Start's own reconcile may already have read the new job's file.
    assert ep["state"] in ("PENDING", "STARTING"), ep
    return ep


def serve_and_chat(launcher: ExtraLauncher, stack: Stack, slurm: SlurmCluster, root: Path, name: str) -> str:
    """start → endpoint file → READY → chat through the gateway; returns the job id."""
    endpoint_file = root / "work" / f"{name}.endpoint"
    t0 = time.monotonic()
    ep = start(launcher, stack, root, name)
    job = str(ep["job_id"])
    submitted = time.monotonic() - t0
    published = wait_for(endpoint_file.is_file, 120, 0.2, "the endpoint file")
    ready = wait_for(lambda: launcher.cli(stack, "serve", "llm", "health", name).returncode == 0,
                     LOAD_TIMEOUT_S, 2, f"{name} READY")
    print(f"\n[{name}] submit {submitted:.1f} s → endpoint file +{published:.1f} s → READY +{ready:.1f} s "
          f"(total {time.monotonic() - t0:.1f} s)")
    listed = json.loads(launcher.cli(stack, "--json", "serve", "llm", "list").stdout)
    record = next(e for e in listed if e["name"] == name)
    assert record["state"] == "READY" and record["base_url"] == endpoint_file.read_text().splitlines()[0]

    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    try:
        wait_until(lambda: any(m.id == name for m in client.models.list()), 10)
        t1 = time.monotonic()
        resp = client.chat.completions.create(model=name, max_tokens=16,
                                              messages=[{"role": "user", "content": "Say hello."}])
        print(f"[{name}] first chat through the gateway: {time.monotonic() - t1:.2f} s")
    finally:
        client.close()
    assert resp.choices[0].message.content and resp.usage is not None and resp.usage.completion_tokens > 0
    status = json.loads(launcher.cli(stack, "--json", "serve", "llm", "status", name).stdout)
    assert status["substrate"]["job_state"] == "RUNNING"
    assert "requests_running" in status["metrics"] and "kv_cache_usage" in status["metrics"]
    assert status["metrics"]["ttft_requests"] >= 1
    return job


def stop(launcher: ExtraLauncher, stack: Stack, slurm: SlurmCluster, name: str, job: str) -> None:
    out = launcher.cli(stack, "--json", "serve", "llm", "stop", name, "--yes")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "STOPPED"
    wait_for(lambda: job not in slurm.queued(), 60, 0.5, f"job {job} gone from the queue")



@pytest.fixture(autouse=True)
def no_job_left_behind(slurm: SlurmCluster) -> Iterator[None]:
    yield
    slurm.cancel_all()

@pytest.fixture(scope="module")
def local_launcher(stack: Stack, slurm: SlurmCluster,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ExtraLauncher, Path]]:
    root = tmp_path_factory.mktemp("vllm-slurm")
    write_pack(root, "smol-slurm")
    with extra_launcher(stack, root, "launcher-vllm-slurm", {**slurm.env, **launcher_settings(root)}) as launcher:
        yield launcher, root


@pytest.mark.timeout(1500)
def test_real_vllm_as_a_slurm_job(local_launcher: tuple[ExtraLauncher, Path], stack: Stack,
                                  slurm: SlurmCluster) -> None:
    launcher, root = local_launcher
    name = "smol-slurm"
    job = serve_and_chat(launcher, stack, slurm, root, name)
    old_url = json.loads(launcher.cli(stack, "--json", "serve", "llm", "list").stdout)
    old_url = next(e for e in old_url if e["name"] == name)["base_url"]
    stop(launcher, stack, slurm, name, job)
    gone = launcher.cli(stack, "gateway", "chat", name, "-m", "still there?")
    assert gone.returncode == 1 and ("STOPPED" in gone.stderr or "not routed" in gone.stderr), gone.stderr

    # Restart: a stale endpoint file of the old job (as a crashed job would leave) is never used.
    endpoint_file = root / "work" / f"{name}.endpoint"
    endpoint_file.write_text(f"{old_url}\njob={job}\n")
    again = start(launcher, stack, root, name)
    assert again["job_id"] != job
    health = launcher.cli(stack, "--json", "serve", "llm", "health", name)
    assert health.returncode == 1 and json.loads(health.stdout)["endpoint"]["base_url"] != old_url
    wait_for(lambda: endpoint_file.is_file() and f"job={again['job_id']}" in endpoint_file.read_text(), 120, 0.2,
             "the new job's endpoint file")
    launcher.cli(stack, "serve", "llm", "health", name)
    listed = json.loads(launcher.cli(stack, "--json", "serve", "llm", "list").stdout)
    new_url = next(e for e in listed if e["name"] == name)["base_url"]
    assert new_url and new_url != old_url and new_url == endpoint_file.read_text().splitlines()[0]
    stop(launcher, stack, slurm, name, str(again["job_id"]))


@pytest.mark.timeout(1200)
def test_real_vllm_through_the_ssh_transport(stack: Stack, slurm: SlurmCluster, sshd: SshServer,
                                             tmp_path: Path) -> None:
    name = "smol-ssh"
    write_pack(tmp_path, name)
    with extra_launcher(stack, tmp_path, "launcher-vllm-ssh", {**sshd.launcher_env(), **launcher_settings(tmp_path)}
                        ) as launcher:
        job = serve_and_chat(launcher, stack, slurm, tmp_path, name)
        jobs = json.loads(launcher.cli(stack, "--json", "hpc", "jobs", "--name", name).stdout)
        assert jobs[0]["transport"] == "ssh" and jobs[0]["state"] == "RUNNING"
        stop(launcher, stack, slurm, name, job)
