"""The renderers: what argv and environment a launcher receives for an engine block."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from examlops.engine import (
    DENY_ALL_MEDIA_DOMAINS,
    VLLM_API_KEY_ENV,
    EngineBlock,
    EngineBlockError,
    parse_engine_block,
    render_sglang_command,
    render_vllm_command,
)

VISION: dict[str, Any] = {"modality": "vision", "limit_mm_per_prompt": {"image": 2}}


def block(**fields: Any) -> EngineBlock:
    return parse_engine_block({"engine": "vllm", "hf_model_id": "org/model", **fields})


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} should appear once in {argv}"
    return argv[argv.index(flag) + 1]


def test_argv_starts_with_vllm_serve_and_the_model() -> None:
    argv = render_vllm_command(block()).argv
    assert argv[:3] == ["vllm", "serve", "org/model"]
    assert render_vllm_command(block(), model="/models/local").argv[2] == "/models/local"


def test_every_field_lands_on_its_flag() -> None:
    argv = render_vllm_command(block(
        served_model_name="m", dtype="float16", max_model_len=4096, tensor_parallel_size=4,
        pipeline_parallel_size=2, gpu_memory_utilization=0.85, kv_cache_dtype="fp8_e5m2",
        quantization="awq", enable_chunked_prefill=False, prefix_cache=True,
    ), host="0.0.0.0", port=9000).argv
    expected = {
        "--served-model-name": "m", "--dtype": "float16", "--max-model-len": "4096",
        "--tensor-parallel-size": "4", "--pipeline-parallel-size": "2",
        "--gpu-memory-utilization": "0.85", "--kv-cache-dtype": "fp8_e5m2",
        "--quantization": "awq", "--host": "0.0.0.0", "--port": "9000",
    }
    assert {flag: flag_value(argv, flag) for flag in expected} == expected
    assert "--no-enable-chunked-prefill" in argv and "--enable-prefix-caching" in argv


def test_unset_tuning_fields_leave_vllm_defaults_alone() -> None:
    argv = render_vllm_command(block()).argv
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-dtype", "--quantization",
                 "--speculative-config", "--limit-mm-per-prompt", "--port", "--host"):
        assert flag not in argv
    assert not any("chunked-prefill" in a or "prefix-caching" in a for a in argv)


def test_port_comes_from_base_url_unless_given() -> None:
    with_url = block(base_url="http://gpu01:8123/")
    assert flag_value(render_vllm_command(with_url).argv, "--port") == "8123"
    assert flag_value(render_vllm_command(with_url, port=9000).argv, "--port") == "9000"
    with pytest.raises(EngineBlockError, match="port: is not a TCP port"):
        render_vllm_command(with_url, port=70000)


@pytest.mark.parametrize(("dtype", "quantization"), [("fp8", "fp8"), ("int4", "gptq"), ("int8", "compressed-tensors")])
def test_spec_dtypes_vllm_lacks_render_as_auto_plus_quantization(dtype: str, quantization: str) -> None:
    fields = {"dtype": dtype} if dtype == "fp8" else {"dtype": dtype, "quantization": quantization}
    argv = render_vllm_command(block(**fields)).argv
    assert (flag_value(argv, "--dtype"), flag_value(argv, "--quantization")) == ("auto", quantization)


def test_speculative_decoding_renders_one_json_config() -> None:
    argv = render_vllm_command(block(speculative_decoding={
        "enabled": True, "method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3, "prompt_lookup_min": 1,
    })).argv
    assert json.loads(flag_value(argv, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
    }
    draft = block(speculative_decoding={"enabled": True, "draft_model": "org/tiny"})
    config = json.loads(flag_value(render_vllm_command(draft).argv, "--speculative-config"))
    assert config == {"method": "draft_model", "model": "org/tiny", "num_speculative_tokens": 3}
    off = block(speculative_decoding={"enabled": False, "draft_model": "org/tiny"})
    assert "--speculative-config" not in render_vllm_command(off).argv


def test_media_limits_go_onto_the_server_and_its_environment() -> None:
    command = render_vllm_command(block(multimodal={
        **VISION, "allowed_media_domains": ["example.com", "cdn.example.org"],
        "allowed_local_media_path": "/data/media", "mm_processor_cache_gb": 2,
        "max_image_bytes": 5 * 1024 * 1024 + 1,
    }))
    argv = command.argv
    assert json.loads(flag_value(argv, "--limit-mm-per-prompt")) == {"image": 2}
    start = argv.index("--allowed-media-domains") + 1
    assert argv[start:start + 2] == ["example.com", "cdn.example.org"]
    assert flag_value(argv, "--allowed-local-media-path") == "/data/media"
    assert float(flag_value(argv, "--mm-processor-cache-gb")) == 2.0
    assert command.env == {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0", "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "6"}


def test_an_empty_domain_allow_list_denies_all_remote_media() -> None:
    argv = render_vllm_command(block(multimodal=VISION)).argv
    start = argv.index("--allowed-media-domains") + 1
    assert argv[start] == DENY_ALL_MEDIA_DOMAINS and DENY_ALL_MEDIA_DOMAINS.endswith(".invalid")
    assert start + 1 == len(argv) or argv[start + 1].startswith("--")


def test_a_text_model_gets_no_media_flags() -> None:
    command = render_vllm_command(block(multimodal={"allowed_media_domains": ["example.com"]}))
    assert not any(a.startswith(("--limit-mm", "--allowed-", "--mm-")) for a in command.argv)
    assert command.env == {}


def test_the_api_key_travels_by_environment_only() -> None:
    secret = "s3cr3t-value"
    command = render_vllm_command(block(api_key_secret_ref="env:GPU_KEY"), environ={"GPU_KEY": secret})
    assert command.env == {VLLM_API_KEY_ENV: secret}
    assert secret not in " ".join(command.argv) and "--api-key" not in command.argv
    assert secret not in repr(command) and secret not in command.shell()
    bare = render_vllm_command(block(api_key_secret_ref="GPU_KEY"), environ={"GPU_KEY": secret})
    assert bare.env == {VLLM_API_KEY_ENV: secret}


def test_a_missing_secret_fails_naming_the_variable() -> None:
    with pytest.raises(EngineBlockError, match="GPU_KEY holding the API key is not set"):
        render_vllm_command(block(api_key_secret_ref="env:GPU_KEY"), environ={})


def test_the_otlp_traces_endpoint_renders_vllms_flag() -> None:
    argv = render_vllm_command(block(otlp_traces_endpoint="http://collector:4317/")).argv
    assert flag_value(argv, "--otlp-traces-endpoint") == "http://collector:4317"
    assert "--otlp-traces-endpoint" not in render_vllm_command(block()).argv


@pytest.mark.parametrize(("url", "why"), [
    ("collector:4317", "not an http(s) URL"), ("grpc://collector:4317", "not an http(s) URL"),
    ("http://user:pw@collector:4318/v1/traces", "OTEL_EXPORTER_OTLP_HEADERS"),
    ("http://collector:4318/v1/traces?x=1", "not a server address"),
])
def test_a_bad_otlp_traces_endpoint_is_refused(url: str, why: str) -> None:
    with pytest.raises(EngineBlockError, match=re.escape(why)):
        block(otlp_traces_endpoint=url)


def test_the_otlp_traces_endpoint_is_owned_and_only_for_a_vllm_server() -> None:
    with pytest.raises(EngineBlockError, match="otlp_traces_endpoint"):
        block(extra_args=["--otlp-traces-endpoint", "http://collector:4317"])
    with pytest.raises(EngineBlockError, match="only a vLLM server exports"):
        parse_engine_block({"engine": "echo", "otlp_traces_endpoint": "http://collector:4317"})


def test_extra_args_come_last_verbatim() -> None:
    argv = render_vllm_command(block(extra_args=["--max-num-seqs", "8", "--enforce-eager"])).argv
    assert argv[-3:] == ["--max-num-seqs", "8", "--enforce-eager"]


@pytest.mark.parametrize("engine", ["echo", "vllm-inproc", "sglang"])
def test_only_server_vllm_renders_a_vllm_command(engine: str) -> None:
    with pytest.raises(EngineBlockError, match="renders engine 'vllm-server' only"):
        render_vllm_command(block(engine=engine))


def test_bad_render_arguments_are_refused() -> None:
    with pytest.raises(EngineBlockError, match="model: cannot be a command-line value"):
        render_vllm_command(block(), model="--help")
    with pytest.raises(EngineBlockError, match="host: cannot be a command-line value"):
        render_vllm_command(block(), host="")


def sglang(**fields: Any) -> EngineBlock:
    return block(engine="sglang", **fields)


def test_sglang_launch_argv() -> None:
    argv = render_sglang_command(sglang(
        served_model_name="m", dtype="bfloat16", max_model_len=8192, tensor_parallel_size=4,
        pipeline_parallel_size=2, gpu_memory_utilization=0.8, kv_cache_dtype="fp8",
        enable_chunked_prefill=False, prefix_cache=False,
    ), port=30000).argv
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "org/model"]
    expected = {
        "--served-model-name": "m", "--dtype": "bfloat16", "--context-length": "8192",
        "--tp-size": "4", "--pp-size": "2", "--mem-fraction-static": "0.8",
        "--kv-cache-dtype": "fp8_e4m3", "--chunked-prefill-size": "-1", "--port": "30000",
    }
    assert {flag: flag_value(argv, flag) for flag in expected} == expected
    assert "--disable-radix-cache" in argv


def test_sglang_speculative_algorithms() -> None:
    argv = render_sglang_command(sglang(speculative_decoding={
        "enabled": True, "method": "eagle3", "draft_model": "org/eagle", "num_speculative_tokens": 3,
    })).argv
    assert flag_value(argv, "--speculative-algorithm") == "EAGLE3"
    assert flag_value(argv, "--speculative-draft-model-path") == "org/eagle"
    assert flag_value(argv, "--speculative-num-steps") == "3"
    assert flag_value(argv, "--speculative-num-draft-tokens") == "4"
    ngram = render_sglang_command(sglang(speculative_decoding={"enabled": True, "method": "ngram"})).argv
    assert flag_value(ngram, "--speculative-algorithm") == "NGRAM"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"multimodal": VISION}, "engine.multimodal.modality"),
        ({"api_key_secret_ref": "KEY"}, "engine.api_key_secret_ref"),
        ({"quantization": "fp8_per_block"}, "engine.quantization"),
        ({"kv_cache_dtype": "float16"}, "engine.kv_cache_dtype"),
        ({"speculative_decoding": {"enabled": True, "method": "ngram", "prompt_lookup_max": 2}},
         "engine.speculative_decoding.prompt_lookup_max"),
    ],
)
def test_sglang_refuses_what_it_cannot_carry_out(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineBlockError) as caught:
        render_sglang_command(sglang(**fields))
    assert [i.field for i in caught.value.issues] == [field]
