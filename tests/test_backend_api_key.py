"""A keyed model server gets its key on both hops: launcher → server, and engine-proxy → server.

The engine block names the variable (`api_key_secret_ref: env:EXAMLOPS_TEST_VLLM_KEY`); the launcher
and engine-proxy each hold it in their own environment. Both servers here refuse what vLLM with
VLLM_API_KEY refuses (a /v1 request without `Bearer <key>`), so a call succeeds only if the key
was delivered: the stand-in `vllm` the Slurm job runs, and the recording backend behind the gateway.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import free_port, service_argv, spawn, wait_grpc
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.recorder import RecordingServer
from examlops_testsupport.slurm import ExtraLauncher, SlurmCluster, extra_launcher, wait_for, write_fake_vllm

KEY_VAR = "EXAMLOPS_TEST_VLLM_KEY"
KEY = "sk-test-vllm-" + "k7" * 16
BLOCK = {"engine": "vllm", "hf_model_id": "org/keyed-model", "api_key_secret_ref": f"env:{KEY_VAR}"}


@pytest.fixture(scope="module")
def hpc(stack: Stack, slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraLauncher]:
    root = tmp_path_factory.mktemp("keyed-hpc")
    (root / "packs" / "models").mkdir(parents=True)
    (root / "packs" / "models" / "fake-keyed-local.yaml").write_text(json.dumps({"engine": BLOCK}))
    settings = {**slurm.env, "EXAMLOPS_VLLM_WORK_DIR": str(root / "work"), "EXAMLOPS_VLLM_RUNTIME": "path",
                "EXAMLOPS_VLLM_BIN": str(write_fake_vllm(root / "bin")), KEY_VAR: KEY}
    with extra_launcher(stack, root, "launcher-keyed", settings) as launcher:
        launcher.root = root  # type: ignore[attr-defined]
        yield launcher
    slurm.cancel_all()


def test_the_slurm_launcher_starts_the_server_with_the_key_it_requires(hpc: ExtraLauncher, stack: Stack) -> None:
    root: Path = hpc.root  # type: ignore[attr-defined]
    out = hpc.cli(stack, "--json", "serve", "llm", "start", "fake-keyed-local", "--launcher", "slurm", "--gpus", "1",
                  "--port", str(free_port()), "--yes", env={"EXAMLOPS_USECASE_DIR": str(root / "packs")})
    assert out.returncode == 0, out.stderr
    wait_for(lambda: hpc.cli(stack, "serve", "llm", "health", "fake-keyed-local").returncode == 0, 60, 0.5,
             "the keyed server READY")
    listed = json.loads(hpc.cli(stack, "--json", "serve", "llm", "list").stdout)
    base_url = next(e for e in listed if e["name"] == "fake-keyed-local")["base_url"]
    assert httpx.get(base_url + "/v1/models", timeout=10).status_code == 401  # the server is keyed...
    keyed = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert keyed.status_code == 200  # ...with exactly the launcher's key
    assert hpc.cli(stack, "serve", "llm", "stop", "fake-keyed-local", "--yes").returncode == 0


@pytest.fixture(scope="module")
def keyed_gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway replica whose engine-proxy (its own process) holds the key; both follow the stack's registry."""
    port = free_port()
    env = {**stack.env("engine-proxy"), KEY_VAR: KEY, "EXAMLOPS_PORT": str(port)}
    proxy = spawn("engine-proxy-keyed", service_argv("engine-proxy"), env,
                  tmp_path_factory.mktemp("keyed") / "engine-proxy.log")
    try:
        wait_grpc(f"127.0.0.1:{port}", 30, proxy)
        _, url = stack.start_gateway_replica("gateway-keyed", {"EXAMLOPS_ENGINE_PROXY_ADDR": f"127.0.0.1:{port}"})
        yield url
        stack.stop("gateway-keyed")
    finally:
        proxy.stop(signal.SIGTERM)


def test_engine_proxy_sends_the_key_the_endpoint_names(stack: Stack, keyed_gateway: str) -> None:
    backend = RecordingServer(api_key=KEY)
    try:
        stack.register("keyed-b", engine="vllm-server", base_url=backend.url, served_model_name="org/keyed-model",
                       engine_block_json=json.dumps({**BLOCK, "engine": "vllm-server"}))
        client = openai.OpenAI(base_url=keyed_gateway + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        wait_until(lambda: any(m.id == "keyed-b" for m in client.models.list()), 10)
        for stream in (False, True):
            reply = client.chat.completions.create(model="keyed-b", messages=[{"role": "user", "content": "hi"}],
                                                   stream=stream)
            text = reply.choices[0].message.content if not stream else "".join(  # type: ignore[union-attr]
                c.choices[0].delta.content or "" for c in reply if c.choices)  # type: ignore[union-attr]
            assert text == "recorded"
        assert backend.refused == 0 and len(backend.bodies) == 2
        # The control: without the key this backend refuses, as a keyed vLLM does.
        bare = httpx.post(backend.url + "/v1/chat/completions", json={"model": "org/keyed-model", "messages": []})
        assert bare.status_code == 401 and backend.refused == 1
    finally:
        backend.close()
