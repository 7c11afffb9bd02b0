"""A real three-master Redis Cluster on free local ports, for the tests that run the services on one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from examlops_devstack import Proc, free_port, spawn

MASTERS = 3


@dataclass
class RedisClusterServer:
    """Three `redis-server --cluster-enabled yes` masters, slots spread by `redis-cli --cluster create`."""

    ports: list[int]
    dir: Path
    procs: list[Proc]

    @property
    def port(self) -> int:
        """The first master's port (a stack's nominal Redis port; its URL is `url`)."""
        return self.ports[0]

    @property
    def url(self) -> str:
        """EXAMLOPS_REDIS_URL of the services: every master a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def client(self) -> RedisCluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports], decode_responses=True)

    def node(self, port: int) -> redis.Redis:
        """One master on its own (CLUSTER and SCAN of that node only)."""
        return redis.Redis(port=port, decode_responses=True)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def _start_node(workdir: Path, port: int, bus_port: int, exe: str) -> Proc:
    workdir.mkdir(parents=True, exist_ok=True)
    return spawn(f"redis-{port}", [
        exe, "--port", str(port), "--cluster-port", str(bus_port), "--bind", "127.0.0.1", "--dir", str(workdir),
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
        "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
        {}, workdir / "redis.log")


def _cluster_ok(ports: list[int]) -> bool:
    for port in ports:
        try:
            with redis.Redis(port=port, decode_responses=True) as node:
                if node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":  # parsed to a dict
                    return False
        except redis.RedisError:
            return False
    return True


def start_redis_cluster(workdir: Path) -> RedisClusterServer:
    """Start three masters, join them with `redis-cli --cluster create` and wait for cluster_state:ok."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise RuntimeError("redis-server and redis-cli are not installed: run `make test` "
                           "(it installs Debian's redis-server, which brings redis-tools)")
    ports = [free_port() for _ in range(MASTERS)]
    procs: list[Proc] = []
    server = RedisClusterServer(ports, workdir, procs)
    try:
        for port in ports:
            procs.append(_start_node(workdir / str(port), port, free_port(), exe))
        deadline = time.monotonic() + 10
        for port, proc in zip(ports, procs, strict=True):
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    if redis.Redis(port=port).ping():
                        break
                if time.monotonic() > deadline or not proc.alive():
                    raise RuntimeError(f"redis {port} did not start:\n{proc.log_tail()}")
                time.sleep(0.02)
        created = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                                  "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        deadline = time.monotonic() + 30
        while not _cluster_ok(ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok within 30 s")
            time.sleep(0.1)
    except BaseException:
        server.stop()
        raise
    return server
