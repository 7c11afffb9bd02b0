"""Every internal gRPC call is authenticated; the audited actor is the credential; secrets stay out of logs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.launcher.v1 import launcher_pb2 as la
from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc
from examlops.mediaguard.v1 import mediaguard_pb2 as mg
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as mg_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason
from examlops_devstack import SERVICES, free_port, stack_tokens
from examlops_testsupport.fixtures import TEST_OPERATOR, Stack

#: One harmless call per gRPC service: (stub, call) -> the response.
CALLS: dict[str, Callable[[grpc.Channel], Any]] = {
    "registry": lambda ch: reg_grpc.RegistryStub(ch).ListEndpoints(reg.ListEndpointsRequest(), timeout=10),
    "launcher": lambda ch: la_grpc.LauncherStub(ch).Plan(
        la.StartRequest(name="auth-plan", launcher="external", engine_block_json='{"engine": "echo"}'), timeout=10),
    "mediaguard": lambda ch: mg_grpc.MediaGuardStub(ch).Validate(
        mg.ValidateRequest(messages_json=b'[{"role": "user", "content": "hi"}]', policy_json=b"{}"), timeout=10),
    "engine-proxy": lambda ch: ep_grpc.EngineProxyStub(ch).ListRoutes(ep.ListRoutesRequest(), timeout=10),
}
GRPC_SERVICES = list(CALLS)
UNKNOWN_TOKEN = "x" * 43  # long enough to be a token, listed nowhere
SECRET_ADMIN_KEY = "adm-" + "s3cr3t" * 8
REDIS_PASSWORD = "hunter2-redis-password"


def refusal(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_a_call_without_a_token_is_unauthenticated_and_names_the_variable(stack: Stack, name: str) -> None:
    with grpc.insecure_channel(stack.ports.addr(name)) as ch:
        err = refusal(lambda: CALLS[name](ch))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    details = err.details() or ""  # type: ignore[attr-defined]
    assert "EXAMLOPS_SERVICE_TOKEN" in details and "EXAMLOPS_OPERATOR_TOKEN" in details, details
    assert "EXAMLOPS_INTERNAL_TOKENS" in details
    assert error_reason(err) == ("unauthenticated", "authorization")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_a_call_with_a_wrong_token_is_unauthenticated(stack: Stack, name: str) -> None:
    with stack.channel(name, UNKNOWN_TOKEN) as ch:
        err = refusal(lambda: CALLS[name](ch))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "EXAMLOPS_OPERATOR_TOKEN" in (err.details() or "")  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_a_call_with_a_valid_token_is_answered(stack: Stack, name: str) -> None:
    with stack.channel(name) as ch:
        assert CALLS[name](ch) is not None


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_health_checks_need_no_token(stack: Stack, name: str) -> None:
    with grpc.insecure_channel(stack.ports.addr(name)) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_server_stream_is_refused_without_a_token(stack: Stack) -> None:
    with grpc.insecure_channel(stack.ports.addr("registry")) as ch:
        err = refusal(lambda: next(iter(reg_grpc.RegistryStub(ch).WatchEndpoints(
            reg.WatchEndpointsRequest(), timeout=5))))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_an_unauthenticated_price_change_is_refused_and_changes_nothing(stack: Stack) -> None:
    price = reg.Price(model="auth-price", input_micro_usd_per_mtok=1, output_micro_usd_per_mtok=1)
    for token in (None, UNKNOWN_TOKEN):
        ch = grpc.insecure_channel(stack.ports.addr("registry")) if token is None else stack.channel("registry", token)
        with ch:
            err = refusal(lambda ch=ch: reg_grpc.RegistryStub(ch).SetPrice(  # type: ignore[misc]
                reg.SetPriceRequest(price=price, actor="cli:tests"), timeout=5))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    r = stack.registry()
    assert "auth-price" not in {p.model for p in r.ListPrices(reg.ListPricesRequest(), timeout=5).prices}
    assert not r.ListAuditEvents(reg.ListAuditEventsRequest(target="price:auth-price"), timeout=5).events


def test_a_service_may_call_only_what_its_rules_allow(stack: Stack) -> None:
    # engine-proxy reads the route table; it may not change prices. The gateway never calls mediaguard.
    with stack.channel("registry", stack.tokens.tokens["engine-proxy"]) as ch:
        registry = reg_grpc.RegistryStub(ch)
        registry.ListEndpoints(reg.ListEndpointsRequest(), timeout=5)
        err = refusal(lambda: registry.SetPrice(reg.SetPriceRequest(price=reg.Price(model="auth-ro")), timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "'engine-proxy'" in (err.details() or "")  # type: ignore[attr-defined]
    with stack.channel("mediaguard", stack.tokens.tokens["gateway"]) as ch:
        err = refusal(lambda: CALLS["mediaguard"](ch))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]


def test_the_audited_actor_is_the_credential_not_the_claim(stack: Stack) -> None:
    # An operator claiming to be someone else is audited as itself.
    stack.registry().SetPrice(reg.SetPriceRequest(
        price=reg.Price(model="auth-actor", input_micro_usd_per_mtok=5), actor="mallory"), timeout=5)
    [event] = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target="price:auth-actor"), timeout=5).events
    assert (event.actor, event.on_behalf_of) == (TEST_OPERATOR, "")
    prices = {p.model: p for p in stack.registry().ListPrices(reg.ListPricesRequest(), timeout=5).prices}
    assert prices["auth-actor"].updated_by == TEST_OPERATOR
    # A service names the user it acts for: kept as on_behalf_of, never as the actor.
    with stack.channel("registry", stack.tokens.tokens["launcher"]) as ch:
        reg_grpc.RegistryStub(ch).RecordAuditEvent(reg.RecordAuditEventRequest(event=reg.AuditEvent(
            actor="alice", action="key.issue", target="key:auth-k1")), timeout=5)
    [event] = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target="key:auth-k1"), timeout=5).events
    assert (event.actor, event.on_behalf_of) == ("launcher", "alice")


def test_the_gateway_admin_api_is_audited_as_the_gateway_for_the_claimed_operator(stack: Stack) -> None:
    resp = httpx.post(stack.gateway_url + "/admin/keys", timeout=10,
                      headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}", "X-Examlops-Actor": "carol"},
                      json={"tenant": "auth", "project": "auth-p", "models": ["echo"]})
    assert resp.status_code == 201, resp.text
    key_id = resp.json()["id"]
    [event] = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target=f"key:{key_id}"), timeout=5).events
    assert (event.actor, event.on_behalf_of) == ("gateway", "carol")


def test_the_launcher_acts_for_the_authenticated_operator(stack: Stack) -> None:
    out = stack.cli("--json", "serve", "llm", "start", "auth-cli", "--engine", "echo", env={"EXAMLOPS_ACTOR": "root"})
    assert out.returncode == 0, out.stderr
    events = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(
        target="endpoint:auth-cli", action="register"), timeout=5).events
    assert [(e.actor, e.on_behalf_of) for e in events] == [("launcher", TEST_OPERATOR)]


def test_the_cli_names_the_variable_when_its_token_is_refused(stack: Stack) -> None:
    out = stack.cli("serve", "llm", "list", env={"EXAMLOPS_OPERATOR_TOKEN": UNKNOWN_TOKEN})
    assert out.returncode == 1
    assert "EXAMLOPS_OPERATOR_TOKEN" in out.stderr and UNKNOWN_TOKEN not in out.stderr
    env = stack.cli("--json", "dev", "env")
    assert env.returncode == 0, env.stderr
    assert f'"EXAMLOPS_OPERATOR_TOKEN": "{stack.tokens.operator_token}"' in env.stdout


def test_dev_tokens_are_private_and_generated_once(tmp_path: Path) -> None:
    first = stack_tokens(tmp_path, "cli:alice")
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "operator-token").stat().st_mode) == 0o600
    assert (tmp_path / "operator-token").read_text().strip() == first.tokens["cli:alice"]
    assert set(first.tokens) == {"gateway", "launcher", "engine-proxy", "cli:alice"}
    assert len(set(first.tokens.values())) == 4 and all(len(t) >= 32 for t in first.tokens.values())
    assert stack_tokens(tmp_path, "cli:alice").tokens == first.tokens


# --- start-up checks and log redaction (each service as its own process) ----------------------

def run_service(name: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EXAMLOPS_")}
    return subprocess.run([sys.executable, "-m", SERVICES[name]], capture_output=True, text=True, timeout=timeout,
                          env={**clean, "EXAMLOPS_PORT": "0", **env})


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_a_server_without_callers_refuses_to_start(name: str) -> None:
    out = run_service(name, {})
    assert out.returncode == 2
    assert "EXAMLOPS_INTERNAL_TOKENS" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("var", "value"), [
    ("EXAMLOPS_INTERNAL_TOKENS", "cli:alice=short-token-xyz"),
    ("EXAMLOPS_SERVICE_TOKEN", "short-token-xyz"),
])
def test_a_short_token_is_refused_at_start_naming_the_variable(var: str, value: str) -> None:
    env = {"EXAMLOPS_INTERNAL_TOKENS": "cli:ok=" + "k" * 40, var: value}
    out = run_service("registry", env)
    assert out.returncode == 2
    assert var in out.stderr and "32" in out.stderr, out.stderr
    assert "short-token-xyz" not in out.stderr


def test_a_settings_error_does_not_print_the_admin_key_or_a_redis_password() -> None:
    out = run_service("gateway", {"EXAMLOPS_REPLICA_TTL_S": "1", "EXAMLOPS_ADMIN_KEY": SECRET_ADMIN_KEY,
                                  "EXAMLOPS_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0"})
    assert out.returncode == 2
    assert "EXAMLOPS_REPLICA_TTL_S" in out.stderr
    assert SECRET_ADMIN_KEY not in out.stderr and REDIS_PASSWORD not in out.stderr


@pytest.mark.parametrize("name", ["registry", "gateway"])
def test_a_redis_url_with_a_password_is_logged_redacted(name: str) -> None:
    port = free_port()  # nothing listens there
    env = {"EXAMLOPS_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0",
           "EXAMLOPS_INTERNAL_TOKENS": "cli:ok=" + "k" * 40, "EXAMLOPS_ADMIN_KEY": SECRET_ADMIN_KEY}
    out = run_service(name, env)
    assert out.returncode != 0
    assert f"redis://:***@127.0.0.1:{port}/0" in out.stderr, out.stderr
    assert REDIS_PASSWORD not in out.stdout + out.stderr
