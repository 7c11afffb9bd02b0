"""The session fixtures every test tier shares: Redis, the stack of services, Slurm, sshd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis
from examlops_testsupport.slurm import SlurmCluster, SshServer, slurm_cluster, ssh_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.proc.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), redis_server) as s:
        yield s


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real one-node Slurm on localhost (scripts/slurm-local.sh; installs its packages if missing)."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, slurm: SlurmCluster) -> Iterator[SshServer]:
    """A real sshd on 127.0.0.1 standing in for the login node; its sessions see the Slurm above."""
    with ssh_server(tmp_path_factory.mktemp("sshd"), slurm.env) as server:
        yield server
