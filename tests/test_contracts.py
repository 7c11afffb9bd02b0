"""Contracts: stubs match protos; every service starts, serves grpc.health.v1 and fails fast on bad settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from examlops.launcher.v1 import launcher_pb2 as la
from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc
from examlops.svc import error_reason
from examlops_devstack import SERVICES
from examlops_testsupport.fixtures import Stack

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", [n for n in SERVICES if n != "gateway"])
def test_grpc_services_serve_health(stack: Stack, name: str) -> None:
    service = {"registry": "examlops.registry.v1.Registry", "launcher": "examlops.launcher.v1.Launcher",
               "mediaguard": "examlops.mediaguard.v1.MediaGuard",
               "engine-proxy": "examlops.engine_proxy.v1.EngineProxy"}[name]
    with grpc.insecure_channel(stack.ports.addr(name)) as ch:
        for svc in ("", service):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_launcher_refuses_an_unknown_launcher_with_a_reason(stack: Stack) -> None:
    with stack.channel("launcher") as ch, pytest.raises(grpc.RpcError) as info:
        la_grpc.LauncherStub(ch).Start(la.StartRequest(name="x", launcher="nomad"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error_reason(info.value) == ("unknown_launcher", "launcher")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "var", "value"), [
    ("registry", "EXAMLOPS_PORT", "not-a-port"),
    ("gateway", "EXAMLOPS_MAX_BODY_BYTES", "-5"),
    ("engine-proxy", "EXAMLOPS_CONNECT_TIMEOUT_S", "soon"),
    ("launcher", "EXAMLOPS_PORT", "70000"),
    ("mediaguard", "EXAMLOPS_METRICS_PORT", "x"),
])
def test_bad_settings_fail_fast_naming_the_variable(name: str, var: str, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXAMLOPS_")}
    out = subprocess.run([sys.executable, "-m", SERVICES[name]], capture_output=True, text=True, timeout=60,
                         env={**env, var: value})
    assert out.returncode == 2
    assert var in out.stderr and "Traceback" not in out.stderr
