"""The SSH transport refuses a login node whose host key is unknown or changed, and changes nothing.

The launcher hands the login node job scripts and API keys, so it connects only to a host key it
was told (EXAMLOPS_HPC_SSH_KNOWN_HOSTS, and the user's known_hosts); a real sshd on 127.0.0.1 plays
the login node, seen through a known_hosts file without its key, or with another key in its place.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from examlops_testsupport.fixtures import Stack, free_port
from examlops_testsupport.slurm import SlurmCluster, SshServer, extra_launcher, write_fake_vllm


def _known_hosts(tmp_path: Path, sshd: SshServer, case: str) -> Path:
    path = tmp_path / "known_hosts"
    if case == "unknown":
        path.write_text("")
        return path
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    path.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
    return path


@pytest.mark.parametrize(("case", "says"), [("unknown", "not found in known_hosts"), ("changed", "does not match")])
def test_an_unknown_or_changed_host_key_is_refused_and_nothing_happens(
        stack: Stack, sshd: SshServer, slurm: SlurmCluster, tmp_path: Path, case: str, says: str) -> None:
    name = f"fake-hostkey-{case}"
    work = tmp_path / "work"
    settings = {**sshd.launcher_env(), "EXAMLOPS_HPC_SSH_KNOWN_HOSTS": str(_known_hosts(tmp_path, sshd, case)),
                "EXAMLOPS_HPC_SSH_TIMEOUT_S": "10", "EXAMLOPS_VLLM_WORK_DIR": str(work),
                "EXAMLOPS_VLLM_RUNTIME": "path", "EXAMLOPS_VLLM_BIN": str(write_fake_vllm(tmp_path / "bin"))}
    queued = set(slurm.queued())
    with extra_launcher(stack, tmp_path, f"launcher-{name}", settings) as launcher:
        out = launcher.cli(stack, "serve", "llm", "start", name, "--launcher", "slurm", "--hf-model", "org/m",
                           "--gpus", "1", "--port", str(free_port()), "--yes")
        assert out.returncode == 1
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"cannot reach the login node {sshd.user}@127.0.0.1:{sshd.port} over SSH" in out.stderr
        assert says in out.stderr, out.stderr
        # Nothing staged, submitted or registered; the attempt is audited as failed.
        assert not work.exists() and set(slurm.queued()) == queued
        assert name not in launcher.cli(stack, "serve", "llm", "list").stdout
        events = json.loads(launcher.cli(stack, "--json", "audit", "list", "--target", f"endpoint:{name}").stdout)
        assert [e["action"] for e in events] == ["start.failed"]
