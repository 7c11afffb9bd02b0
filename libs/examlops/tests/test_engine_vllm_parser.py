"""Rendered argvs, parsed by the argument parser of a real vLLM (the CPU vLLM venv).

One vLLM process serves the whole module (`VllmArgvChecker`): importing vLLM takes seconds,
parsing one argv takes milliseconds. A missing venv FAILS these tests: build it with
scripts/vllm-env.sh (or set EXAMLOPS_VLLM_VENV).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examlops.engine import (
    DENY_ALL_MEDIA_DOMAINS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_FOR_DTYPE,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    VLLM_API_KEY_ENV,
    VLLM_OWNED_FLAGS,
    EngineBlock,
    EngineBlockError,
    ParsedArgv,
    VllmArgvChecker,
    VllmVenvMissingError,
    find_model,
    parse_engine_block,
    render_vllm_command,
    validate_pack_dir,
    vllm_speculative_config,
)

pytestmark = pytest.mark.vllm

SAMPLE_PACK = Path(__file__).resolve().parents[3] / "usecases" / "sample"
RENDERED_DESTS = [
    "model", "served_model_name", "host", "port", "dtype", "quantization", "quantization_config",
    "max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
    "kv_cache_dtype", "enable_chunked_prefill", "enable_prefix_caching", "speculative_config",
    "spec_method", "spec_model", "spec_tokens", "limit_mm_per_prompt", "allowed_media_domains",
    "allowed_local_media_path", "mm_processor_cache_gb", "api_key", "config", "runner", "convert",
    "otlp_traces_endpoint",
]
#: Flags a model file may pass through extra_args, and the namespace value each must produce.
EXTRA_ARGS: list[tuple[list[str], str, Any]] = [
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--enforce-eager"], "enforce_eager", True),
    (["--seed", "7"], "seed", 7),
    (["--max-num-batched-tokens", "4096"], "max_num_batched_tokens", 4096),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--disable-log-stats"], "disable_log_stats", True),
]


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmArgvChecker]:
    try:
        checker = VllmArgvChecker()
    except VllmVenvMissingError as exc:
        pytest.fail(str(exc))
    with checker:
        yield checker


def assert_parsed(result: ParsedArgv) -> dict[str, Any]:
    assert result.ok, f"vLLM refused the rendered argv:\n  {result.argv}\n  {result.error}"
    return result.namespace


# --- strategies for VALID engine blocks -------------------------------------------------------

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)
model_ids = st.one_of(names, st.builds(lambda a, b: f"{a}/{b}", names, names))
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,8}[a-z0-9](\.[a-z]{2,6}){1,2}", fullmatch=True)


@st.composite
def speculative(draw: st.DrawFn) -> dict[str, Any]:
    method = draw(st.sampled_from(SPECULATIVE_METHODS))
    spec: dict[str, Any] = {"enabled": draw(st.booleans()), "method": method,
                            "num_speculative_tokens": draw(st.integers(1, 8))}
    if method in ("draft_model", "eagle", "eagle3"):
        spec["draft_model"] = draw(model_ids)
    if method == "ngram" and draw(st.booleans()):
        low = draw(st.integers(1, 4))
        spec |= {"prompt_lookup_min": low, "prompt_lookup_max": draw(st.integers(low, 8))}
    return spec


@st.composite
def multimodal(draw: st.DrawFn) -> dict[str, Any]:
    modality = draw(st.sampled_from(["text", "vision", "audio", "video"]))
    policy: dict[str, Any] = {"modality": modality}
    if modality == "text":
        return policy
    kinds = {"vision": ["image"], "audio": ["audio"], "video": ["video", "image"]}[modality]
    policy["limit_mm_per_prompt"] = {kinds[0]: draw(st.integers(1, 8))}
    if len(kinds) > 1 and draw(st.booleans()):
        policy["limit_mm_per_prompt"][kinds[1]] = draw(st.integers(0, 4))
    policy["allowed_media_domains"] = draw(st.lists(hosts, max_size=3, unique=True))
    if draw(st.booleans()):
        policy["allowed_local_media_path"] = draw(st.sampled_from(["/data/media", "/srv/img"]))
    if draw(st.booleans()):
        policy["mm_processor_cache_gb"] = draw(st.floats(0, 64, allow_nan=False))
    if draw(st.booleans()):
        policy["max_image_bytes"] = draw(st.integers(1, 1 << 30))
    return policy


@st.composite
def engine_blocks(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    block: dict[str, Any] = {
        "engine": draw(st.sampled_from(["vllm", "vllm-server"])),
        "hf_model_id": draw(model_ids),
        "dtype": dtype,
    }
    if dtype in QUANTIZATION_FOR_DTYPE:
        allowed = st.sampled_from(QUANTIZATION_FOR_DTYPE[dtype])
        quantization = draw(st.none() | allowed if dtype == "fp8" else allowed)
    else:
        quantization = draw(st.none() | st.sampled_from(QUANTIZATIONS))
    if quantization is not None or draw(st.booleans()):
        block["quantization"] = quantization
    optional = {
        "served_model_name": names,
        "base_url": st.builds(lambda p: f"http://gpu01:{p}", st.integers(1, 65535)),
        "max_model_len": st.integers(16, 1 << 20),
        "tensor_parallel_size": st.integers(1, 16),
        "pipeline_parallel_size": st.integers(1, 8),
        "gpu_memory_utilization": st.floats(0, 1, exclude_min=True),
        "kv_cache_dtype": st.sampled_from(KV_CACHE_DTYPES),
        "enable_chunked_prefill": st.booleans(),
        "prefix_cache": st.booleans(),
        "speculative_decoding": speculative(),
        "multimodal": multimodal(),
        "api_key_secret_ref": st.just("env:EXAMLOPS_TEST_KEY"),
        "otlp_traces_endpoint": st.sampled_from(["http://127.0.0.1:4317", "https://otel.example.com/v1/traces"]),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            nullable = key not in ("multimodal", "tensor_parallel_size", "pipeline_parallel_size")
            block[key] = draw(st.none() | strategy if nullable else strategy)
    chosen = draw(st.lists(st.integers(0, len(EXTRA_ARGS) - 1), unique=True, max_size=3))
    block["extra_args"] = [token for i in chosen for token in EXTRA_ARGS[i][0]]
    if draw(st.booleans()):
        block["task"] = draw(st.sampled_from(["generate", "embed"]))
    if block.get("task") == "embed":  # what an embedding block cannot have
        if block.get("speculative_decoding"):
            block["speculative_decoding"] = {**block["speculative_decoding"], "enabled": False}
        block.pop("multimodal", None)
    return block


def expected_namespace(block: EngineBlock, model: str | None, port: int | None) -> dict[str, Any]:
    policy = block.multimodal
    media = bool(policy.media_kinds)
    if port is None and block.base_url is not None:
        port = int(block.base_url.rsplit(":", 1)[1])
    expected: dict[str, Any] = {
        "model": model or block.hf_model_id,
        "served_model_name": None if block.served_model_name is None else [block.served_model_name],
        "dtype": block.dtype if block.dtype not in QUANTIZATION_FOR_DTYPE else "auto",
        "quantization": block.effective_quantization,
        "max_model_len": block.max_model_len,
        "tensor_parallel_size": block.tensor_parallel_size,
        "pipeline_parallel_size": block.pipeline_parallel_size,
        "kv_cache_dtype": block.kv_cache_dtype or "auto",
        "enable_chunked_prefill": block.enable_chunked_prefill,
        "enable_prefix_caching": block.prefix_cache,
        "speculative_config": vllm_speculative_config(block),
        "limit_mm_per_prompt": dict(policy.limit_mm_per_prompt) if media else {},
        "allowed_media_domains": (policy.allowed_media_domains or [DENY_ALL_MEDIA_DOMAINS]) if media else None,
        "allowed_local_media_path": (policy.allowed_local_media_path or "") if media else "",
        "api_key": None,
        "runner": "pooling" if block.task == "embed" else "auto",
        "convert": "auto",
        "otlp_traces_endpoint": block.otlp_traces_endpoint,
    }
    if port is not None:
        expected["port"] = port
    if block.gpu_memory_utilization is not None:
        expected["gpu_memory_utilization"] = block.gpu_memory_utilization
    if media and policy.mm_processor_cache_gb is not None:
        expected["mm_processor_cache_gb"] = policy.mm_processor_cache_gb
    for tokens, dest, value in EXTRA_ARGS:
        if tokens[0] in block.extra_args:
            expected[dest] = value
    return expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=engine_blocks(),
    model=st.none() | st.sampled_from(["/models/smollm2", "local-dir"]),
    host=st.none() | st.sampled_from(["0.0.0.0", "127.0.0.1", "gpu01.cluster"]),
    port=st.none() | st.integers(1, 65535),
)
def test_vllm_parses_every_valid_block_into_the_blocks_values(
    vllm: VllmArgvChecker, data: dict[str, Any], model: str | None, host: str | None, port: int | None
) -> None:
    block = parse_engine_block(data)
    assert parse_engine_block(block.model_dump(mode="json")) == block  # the registry's round trip
    secret = "key-that-must-not-reach-argv"
    command = render_vllm_command(block, model=model, host=host, port=port,
                                  environ={"EXAMLOPS_TEST_KEY": secret})
    assert secret not in command.argv
    assert command.env.get(VLLM_API_KEY_ENV) == (secret if block.api_key_secret_ref else None)
    (result,) = vllm.parse([command.argv])
    namespace = assert_parsed(result)
    expected = {**expected_namespace(block, model, port), "host": host}
    assert {k: namespace.get(k) for k in expected} == expected


def test_the_sample_pack_renders_argvs_vllm_accepts(vllm: VllmArgvChecker) -> None:
    specs = [find_model(n, SAMPLE_PACK) for n in ("smol", "llama-8b", "qwen-vl", "minilm")]
    commands = [render_vllm_command(s.engine, environ={"LLAMA_8B_API_KEY": "k"}) for s in specs]
    commands.append(render_vllm_command(specs[0].engine, model="/tmp/smollm2-135m-instruct"))
    for result in vllm.parse([c.argv for c in commands]):
        assert_parsed(result)


def test_the_pack_check_can_ask_vllm_too(vllm: VllmArgvChecker, tmp_path: Path) -> None:
    assert [e for _, e in validate_pack_dir(SAMPLE_PACK, vllm=vllm) if e is not None] == []
    stray = tmp_path / "models" / "stray.yaml"
    stray.parent.mkdir()
    # Schema-valid (a value after a flag), but --enforce-eager takes no value: vLLM refuses.
    stray.write_text('engine: {hf_model_id: org/m, extra_args: ["--enforce-eager", "yes"]}\n')
    assert validate_pack_dir(tmp_path) == [(stray, None)]
    ((_, error),) = validate_pack_dir(tmp_path, vllm=vllm)
    assert error is not None and "vLLM refuses the rendered argv" in str(error) and "yes" in str(error)


def test_the_spec_dtypes_are_exactly_the_ones_vllm_does_not_take(vllm: VllmArgvChecker) -> None:
    choices = set(vllm.describe(["dtype"])["actions"]["dtype"]["choices"])
    assert set(DTYPES) - set(QUANTIZATION_FOR_DTYPE) <= choices
    assert not set(QUANTIZATION_FOR_DTYPE) & choices
    naive = [["vllm", "serve", "org/model", "--dtype", d] for d in QUANTIZATION_FOR_DTYPE]
    assert not any(r.ok for r in vllm.parse(naive))  # why the schema maps them


def test_the_schemas_choices_are_vllms(vllm: VllmArgvChecker) -> None:
    facts = vllm.describe(["kv_cache_dtype"])
    assert set(QUANTIZATIONS) <= set(facts["quantization_methods"])
    assert not set(QUANTIZATIONS) & set(facts["deprecated_quantization_methods"])
    for methods in QUANTIZATION_FOR_DTYPE.values():
        assert set(methods) <= set(QUANTIZATIONS)
    assert set(SPECULATIVE_METHODS) <= set(facts["speculative_methods"])
    assert set(KV_CACHE_DTYPES) <= set(facts["actions"]["kv_cache_dtype"]["choices"])


def test_owned_flags_cover_every_spelling_of_what_the_block_sets(vllm: VllmArgvChecker) -> None:
    facts = vllm.describe(RENDERED_DESTS)
    assert sorted(facts["actions"]) == sorted(RENDERED_DESTS)
    for dest, action in facts["actions"].items():
        for option in action["option_strings"]:
            if option.startswith("--"):
                assert option[2:] in VLLM_OWNED_FLAGS, f"{option} (sets {dest}) is not owned"
            else:
                with pytest.raises(EngineBlockError, match="short options"):
                    parse_engine_block({"hf_model_id": "m", "extra_args": [option, "1"]})
    real = set(facts["option_strings"])
    assert [f for f in VLLM_OWNED_FLAGS if f"--{f}" not in real] == []


def test_vllm_refusals_come_back_with_the_reason(vllm: VllmArgvChecker) -> None:
    results = vllm.parse([
        ["vllm", "serve", "m", "--quantization", "bitsandbytes4"],
        ["vllm", "serve", "m", "--speculative-config", '{"method": "guess"}'],
        ["vllm", "serve", "m", "--limit-mm-per-prompt", '{"image": -1}'],
        ["vllm", "serve", "m", "--no-such-flag"],
        ["python", "-m", "sglang.launch_server"],
    ])
    assert [r.ok for r in results] == [False] * 5
    assert "bitsandbytes4" in results[0].error and "guess" in results[1].error
    assert "--no-such-flag" in results[3].error
    with pytest.raises(AssertionError, match="bitsandbytes4"):
        assert_parsed(results[0])


def test_extra_args_the_strategy_uses_are_accepted_and_abbreviations_refused(vllm: VllmArgvChecker) -> None:
    argv = ["vllm", "serve", "m", *[t for tokens, _, _ in EXTRA_ARGS for t in tokens]]
    namespace = assert_parsed(vllm.parse([argv])[0])
    assert {dest: namespace[dest] for _, dest, _ in EXTRA_ARGS} == {d: v for _, d, v in EXTRA_ARGS}
    # vLLM itself would expand this abbreviation: only the schema stops it.
    (abbreviated,) = vllm.parse([["vllm", "serve", "m", "--tensor-parallel", "3"]])
    assert abbreviated.namespace["tensor_parallel_size"] == 3
    with pytest.raises(EngineBlockError, match="abbreviates --tensor-parallel-size"):
        parse_engine_block({"hf_model_id": "m", "extra_args": ["--tensor-parallel", "3"]})


def test_a_missing_vllm_venv_fails_naming_the_build_script(tmp_path: Path) -> None:
    with pytest.raises(VllmVenvMissingError, match=r"scripts/vllm-env\.sh"):
        VllmArgvChecker(venv=tmp_path)
