"""The engine layer through the real services: block validation, argv, sglang, degrade paths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from examlops.engine import find_model, render_vllm_command
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until
from examlops_testsupport.recorder import RecordingServer

ROOT = Path(__file__).resolve().parent.parent


def test_registry_refuses_an_invalid_block_with_the_schema_messages(stack: Stack) -> None:
    bad = {"engine": "vllm", "hf_model_id": "org/m", "dtype": "int3", "tensor_parallel_size": 0,
           "speculative_decoding": {"enabled": True}, "multimodal": {"modality": "vision"}}
    with pytest.raises(grpc.RpcError) as info:
        stack.registry().RegisterEndpoint(reg.RegisterEndpointRequest(endpoint=reg.Endpoint(
            name="bad-block", engine_block_json=json.dumps(bad))), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error_reason(info.value)[0] == "invalid_endpoint"  # type: ignore[arg-type]
    details = info.value.details() or ""  # type: ignore[attr-defined]
    for expected in ("engine.dtype", "'int3'", "float16", "engine.tensor_parallel_size",
                     "draft_model", "limit_mm_per_prompt"):
        assert expected in details, details
    with pytest.raises(grpc.RpcError):
        stack.registry().GetEndpoint(reg.GetEndpointRequest(name="bad-block"), timeout=5)


def test_validate_lists_every_error_and_check_passes_the_sample_pack(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "models" / "broken.yaml"
    bad.parent.mkdir()
    bad.write_text("engine:\n  engine: tgi\n  dtype: int3\n  colour: blue\n")
    out = stack.cli("models", "engine", "validate", str(bad), str(ROOT / "usecases/sample/models/smol.yaml"))
    assert out.returncode == 1
    for expected in ("engine.engine", "'tgi'", "engine.dtype", "engine.colour", "1 valid, 1 invalid"):
        assert expected in out.stdout, out.stdout
    check = stack.cli("--json", "models", "engine", "check", str(ROOT / "usecases"))
    assert check.returncode == 0, check.stdout + check.stderr
    rows = json.loads(check.stdout)
    assert {Path(r["file"]).stem for r in rows} >= {"smol", "qwen-vl", "llama-8b"} and all(r["valid"] for r in rows)
    assert stack.cli("models", "engine", "check", str(tmp_path)).returncode == 1


def test_args_is_the_one_renderers_argv(stack: Stack) -> None:
    out = stack.cli("--json", "serve", "llm", "args", "qwen-vl")
    assert out.returncode == 0, out.stderr
    expected = render_vllm_command(find_model("qwen-vl", ROOT / "usecases").engine).argv
    assert json.loads(out.stdout) == expected
    assert "--limit-mm-per-prompt" in expected and "--allowed-media-domains" in expected
    # An endpoint that is only registered (not in the pack) renders from its recorded block.
    block = {"engine": "vllm", "hf_model_id": "org/only-registered", "tensor_parallel_size": 2}
    stack.register("only-reg", engine="vllm-server", base_url="http://gpu09:8000", engine_block_json=json.dumps(block))
    argv = json.loads(stack.cli("--json", "serve", "llm", "args", "only-reg").stdout)
    assert argv[:3] == ["vllm", "serve", "org/only-registered"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_sglang_engine_passes_structured_output_through(stack: Stack) -> None:
    server = RecordingServer()
    try:
        block = {"engine": "sglang", "hf_model_id": "org/m"}
        stack.register("sgl", engine="sglang", base_url=server.url, engine_block_json=json.dumps(block))
        with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0) as client:
            msgs = [{"role": "user", "content": "hi"}]

            def answers() -> bool:
                try:
                    client.chat.completions.create(model="sgl", messages=msgs)  # type: ignore[arg-type]
                except openai.NotFoundError:
                    return False
                return True
            wait_until(answers)
            server.bodies.clear()
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
            client.chat.completions.create(model="sgl", messages=msgs,  # type: ignore[arg-type]
                                           extra_body={"guided_regex": "[a-z]+", "ebnf": "root ::= 'x'"})
            client.chat.completions.create(model="sgl", messages=msgs,  # type: ignore[arg-type]
                                           extra_body={"structured_outputs": {"json": schema}})
            rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            server.answers.append('{"a": 1}')  # the gateway validates the answer against the schema
            streamed = list(client.chat.completions.create(model="sgl", messages=msgs,  # type: ignore[arg-type]
                                                           response_format=rf, stream=True))  # type: ignore[arg-type]
        first, second, third = server.bodies
        assert first["regex"] == "[a-z]+" and first["ebnf"] == "root ::= 'x'" and "guided_regex" not in first
        assert json.loads(second["json_schema"]) == schema and "structured_outputs" not in second
        assert third["response_format"] == rf
        assert third["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == '{"a": 1}'
        assert all(c.usage is None for c in streamed)  # the client did not ask for the usage chunk
    finally:
        server.close()


def test_streams_reuse_one_pooled_connection_to_the_engine(stack: Stack) -> None:
    server = RecordingServer()
    try:
        stack.register("pooled", engine="vllm-server", base_url=server.url,
                       engine_block_json=json.dumps({"engine": "vllm", "hf_model_id": "org/m"}))
        with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0) as client:
            msgs = [{"role": "user", "content": "hi"}]
            wait_until(lambda: _answers(client, "pooled"))
            before = server.connections
            for _ in range(8):
                chunks = list(client.chat.completions.create(model="pooled", messages=msgs, stream=True))  # type: ignore[arg-type]
                assert chunks
        assert server.connections - before <= 1  # at most the one a warm pool had not opened yet
    finally:
        server.close()


def _answers(client: openai.OpenAI, model: str) -> bool:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    except openai.NotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def degraded_stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    pack = tmp_path_factory.mktemp("pack")
    (pack / "models").mkdir()
    (pack / "models" / "nobase.yaml").write_text("engine:\n  engine: vllm\n  hf_model_id: org/nobase\n")
    env = {"EXAMLOPS_USECASE_DIR": str(pack), "EXAMLOPS_VLLM_VENV": str(pack / "no-vllm-here"),
           "EXAMLOPS_VLLM_BASE_URL": ""}
    with running_stack(tmp_path_factory.mktemp("degraded"), redis_server, env) as stack:
        yield stack


def test_pack_model_without_a_server_degrades_to_echo_with_a_warning(degraded_stack: Stack) -> None:
    out = degraded_stack.cli("serve", "llm", "chat", "nobase", "-m", "hello there")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "echo: hello there"
    assert "EXAMLOPS_VLLM_BASE_URL" in out.stderr and "echo" in out.stderr
    assert "RuntimeWarning" in (Path(degraded_stack.workdir) / "engine-proxy.log").read_text()


def test_inproc_endpoint_without_vllm_degrades_but_a_down_server_never_does(degraded_stack: Stack) -> None:
    block = {"engine": "vllm-inproc", "hf_model_id": "org/m"}
    degraded_stack.register("inproc", engine="vllm-inproc", engine_block_json=json.dumps(block))
    with openai.OpenAI(base_url=degraded_stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY,
                       max_retries=0) as client:
        def answered() -> openai.types.chat.ChatCompletion | None:
            try:
                return client.chat.completions.with_raw_response.create(  # type: ignore[return-value]
                    model="inproc", messages=[{"role": "user", "content": "hi"}])
            except openai.NotFoundError:
                return None
        wait_until(answered)
        raw = answered()
        assert raw is not None
        assert "vllm-inproc cannot run here" in raw.headers["x-examlops-warning"]  # type: ignore[attr-defined]
        assert raw.parse().choices[0].message.content == "echo: hi"  # type: ignore[attr-defined]
        # The pack model is not registered: the gateway (registered routes only) does not serve it.
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nobase", messages=[{"role": "user", "content": "hi"}])
