"""The session fixtures every test tier shares: Redis, the stack of services, Slurm, sshd, MiniLM, and
SmolLM2 with prefix caching and ngram speculative decoding."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from examlops_devstack import Proc, free_port
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis
from examlops_testsupport.redis_cluster import RedisClusterServer, start_redis_cluster
from examlops_testsupport.slurm import SlurmCluster, SshServer, slurm_cluster, ssh_server
from examlops_testsupport.vllm import smol_spec_block, start_minilm_vllm, start_vllm


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.proc.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServer]:
    """Three Redis Cluster masters (no replicas) on free ports; `running_stack(dir, redis_cluster)`
    runs the services on it (EXAMLOPS_REDIS_URL=redis+cluster://...)."""
    server = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield server
    server.stop()


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


@dataclass(frozen=True)
class VllmServer:
    """A real `vllm serve` the session shares: its port, process and served model name."""

    port: int
    proc: Proc
    served_model_name: str

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT (append /v1/embeddings; register it as an endpoint's base_url)."""
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def minilm_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """all-MiniLM-L6-v2 on a real CPU `vllm serve --runner pooling`, served as `minilm` (384
    dimensions), started once per session (~45 s, ~700 MB). Mark its users `pytest.mark.vllm`."""
    port = free_port()
    proc = start_minilm_vllm(tmp_path_factory.mktemp("minilm-vllm"), port)
    try:
        yield VllmServer(port=port, proc=proc, served_model_name="minilm")
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def smol_spec_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """SmolLM2 on a real CPU `vllm serve` with prefix caching and ngram speculative decoding
    (testsupport.vllm.smol_spec_block), served as `smol`, started once per session. Its users must
    not stop it or change its state for the others. Mark them `pytest.mark.vllm`."""
    port = free_port()
    proc = start_vllm(tmp_path_factory.mktemp("smol-spec-vllm"), port, smol_spec_block(), "vllm-smol-spec.log")
    try:
        yield VllmServer(port=port, proc=proc, served_model_name="smol")
    finally:
        proc.stop()
