"""Every service process runs gRPC with its sockets on the completion-queue poller thread.

examlops.grpcenv must take effect before grpc is first imported; each service package imports it first.
The check is behavioural: after a few hundred calls over a real aio server and channel, gRPC's
EventEngine threads have not woken once per message (with the default they wake thousands of times).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import asyncio, os, re, sys
import {package}  # the service package comes first, as in `python -m {package}`
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{{port}}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(300):
            await stub.Check(health_pb2.HealthCheckRequest())
    wakeups = 0
    for tid in os.listdir("/proc/self/task"):
        if open(f"/proc/self/task/{{tid}}/comm").read().strip() == "event_engine":
            status = open(f"/proc/self/task/{{tid}}/status").read()
            wakeups += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
    await server.stop(None)
    print(os.environ.get("GRPC_EXPERIMENTS", ""), wakeups)

asyncio.run(main())
"""

PACKAGES = ["examlops_gateway", "examlops_engine_proxy", "examlops_registry", "examlops_launcher",
            "examlops_mediaguard"]


def _probe(package: str, env: dict[str, str]) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(package=package)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.split()
    return (out[0] if len(out) > 1 else ""), int(out[-1])


@pytest.mark.parametrize("package", PACKAGES)
def test_service_packages_keep_grpc_off_event_engine_threads(package: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    experiments, wakeups = _probe(package, env)
    assert "-event_engine_client" in experiments
    assert wakeups < 300, f"EventEngine threads woke {wakeups} times for 300 calls"


def test_the_probe_sees_event_engine_threads_without_the_setting() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    _, wakeups = _probe("json", env)
    assert wakeups > 600


def test_an_operators_own_setting_wins() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": "event_engine_client"}
    experiments, _ = _probe("examlops_engine_proxy", env)
    assert experiments == "event_engine_client"
