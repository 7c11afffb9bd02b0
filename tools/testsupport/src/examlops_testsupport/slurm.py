"""Real Slurm and a real sshd on localhost for the launcher's tests (scripts/slurm-local.sh, sshd-local.sh).

Both scripts install their Debian packages when missing (apt-get, as root or with sudo), so a
fresh machine needs nothing done by hand. Each test session gets its own state dirs, started
once and stopped at the end; the daemons are stopped by the pid files the scripts wrote.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from examlops_devstack import Proc, service_argv, spawn, wait_grpc
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fixtures import Stack, wait_until

ROOT = REPO_ROOT
SCRIPTS = ROOT / "scripts"
FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


def _script_env(script: str, action: str, env: dict[str, str], timeout: float = 900) -> dict[str, str]:
    out = subprocess.run(["bash", str(SCRIPTS / script), action], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/{script} {action} failed:\n{out.stderr[-3000:]}")
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


@dataclass
class SlurmCluster:
    dir: Path
    conf: str

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf}

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, env={**os.environ, **self.env})

    def queued(self) -> list[str]:
        """Job ids still in the queue (pending, running or completing)."""
        out = self.run("squeue", "-h", "-o", "%i")
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    def cancel_all(self) -> None:
        """End every job of this (private, per-session) cluster, so a failed test leaves none behind."""
        jobs = self.queued()
        if jobs:
            self.run("scancel", *jobs)
            wait_for(lambda: not self.queued(), 30, 0.2, "the test cluster's queue empty")

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id)
        fields = dict(t.split("=", 1) for t in out.stdout.split() if "=" in t)
        return fields.get("JobState", "GONE")


@contextmanager
def slurm_cluster(state_dir: Path) -> Iterator[SlurmCluster]:
    env = {"EXAMLOPS_SLURM_DIR": str(state_dir)}
    values = _script_env("slurm-local.sh", "start", env)
    try:
        yield SlurmCluster(state_dir, values["SLURM_CONF"])
    finally:
        _script_env("slurm-local.sh", "stop", env, timeout=120)


@dataclass
class SshServer:
    port: int
    user: str
    key: str
    known_hosts: str

    def launcher_env(self) -> dict[str, str]:
        """Settings of a launcher that reaches this sshd as its login node."""
        return {"EXAMLOPS_HPC_TRANSPORT": "ssh", "EXAMLOPS_HPC_SSH_HOST": f"{self.user}@127.0.0.1:{self.port}",
                "EXAMLOPS_HPC_SSH_KEY_FILE": self.key, "EXAMLOPS_HPC_SSH_KNOWN_HOSTS": self.known_hosts}


@contextmanager
def ssh_server(state_dir: Path, session_env: dict[str, str]) -> Iterator[SshServer]:
    env = {"EXAMLOPS_SSHD_DIR": str(state_dir),
           "EXAMLOPS_SSHD_SETENV": "\n".join(f"{k}={v}" for k, v in session_env.items())}
    values = _script_env("sshd-local.sh", "start", env)
    try:
        yield SshServer(int(values["SSH_PORT"]), values["SSH_USER"], values["SSH_KEY"], values["SSH_KNOWN_HOSTS"])
    finally:
        _script_env("sshd-local.sh", "stop", env, timeout=60)


def write_fake_vllm(directory: Path) -> Path:
    """A `vllm` stand-in for the launcher tests that need no model: serves /health and /metrics."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vllm"
    path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_VLLM))} \"$@\"\n")
    path.chmod(0o755)
    return path


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ExtraLauncher:
    """A second launcher process (other settings) beside a stack, sharing its registry."""

    proc: Proc
    addr: str

    def cli(self, stack: Stack, *args: str, timeout: float = 180,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        exa = Path(sys.executable).parent / "exa"
        return subprocess.run([str(exa), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **stack.env(), "EXAMLOPS_LAUNCHER_ADDR": self.addr,
                                   "COLUMNS": "200", **(env or {})})


@contextmanager
def extra_launcher(stack: Stack, workdir: Path, name: str, settings: dict[str, str]) -> Iterator[ExtraLauncher]:
    from examlops_devstack import free_port

    port = free_port()
    env = {**stack.env("launcher"), **settings, "EXAMLOPS_PORT": str(port)}
    proc = spawn(name, service_argv("launcher"), env, workdir / f"{name}.log")
    try:
        wait_grpc(f"127.0.0.1:{port}", 30, proc)
        yield ExtraLauncher(proc, f"127.0.0.1:{port}")
    finally:
        proc.stop(signal.SIGTERM)


def wait_for(check: object, timeout_s: float, interval_s: float = 1.0, what: str = "condition") -> float:
    """`wait_until` with the slower default cadence of scheduler polls."""
    return wait_until(check, timeout_s, interval_s, what)
