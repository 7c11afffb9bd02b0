"""The engine-block schema: every rule rejects with field, value and accepted values named."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from pydantic import ValidationError

from examlops.engine import (
    DTYPES,
    ENGINES,
    MISSING,
    EngineBlock,
    EngineBlockError,
    EngineBlockIssue,
    MultimodalPolicy,
    parse_engine_block,
)

BASE: dict[str, Any] = {"engine": "vllm", "hf_model_id": "org/model"}


def rejected(**fields: Any) -> EngineBlockError:
    with pytest.raises(EngineBlockError) as caught:
        parse_engine_block({**BASE, **fields})
    return caught.value


def issue_for(error: EngineBlockError, field: str) -> EngineBlockIssue:
    matches = [i for i in error.issues if i.field == field]
    assert matches, f"no issue for {field}; got:\n{error}"
    return matches[0]


def test_a_minimal_block_gets_the_documented_defaults() -> None:
    block = parse_engine_block(BASE)
    assert (block.engine, block.mode, block.dtype) == ("vllm-server", "server", "auto")
    assert (block.tensor_parallel_size, block.pipeline_parallel_size) == (1, 1)
    assert block.multimodal.modality == "text" and block.extra_args == []


def test_vllm_is_an_alias_of_vllm_server() -> None:
    assert parse_engine_block(BASE) == parse_engine_block({**BASE, "engine": "vllm-server"})


def test_inproc_engine_defaults_to_inproc_mode() -> None:
    assert parse_engine_block({**BASE, "engine": "vllm-inproc"}).mode == "inproc"


@pytest.mark.parametrize(
    ("engine", "mode", "accepted"),
    [("vllm-inproc", "server", "inproc"), ("vllm", "inproc", "server"), ("sglang", "inproc", "server")],
)
def test_mode_and_engine_must_agree(engine: str, mode: str, accepted: str) -> None:
    issue = issue_for(rejected(engine=engine, mode=mode), "engine.mode")
    assert issue.value == mode and issue.accepted == (accepted,)


def test_unknown_engine_names_every_engine() -> None:
    issue = issue_for(rejected(engine="tgi"), "engine.engine")
    assert issue.value == "tgi" and issue.accepted == ENGINES
    assert "engine.engine: 'tgi' is not accepted" in issue.line()
    assert "vllm, vllm-server, vllm-inproc, sglang, echo" in issue.line()


def test_unknown_dtype_names_every_dtype() -> None:
    issue = issue_for(rejected(dtype="int3"), "engine.dtype")
    assert issue.value == "int3" and issue.accepted == DTYPES


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("value", [0, -2, 2.5, "4", True])
def test_parallel_sizes_are_positive_integers(field: str, value: Any) -> None:
    issue = issue_for(rejected(**{field: value}), f"engine.{field}")
    assert issue.value == value
    assert issue.accepted == ("an integer >= 1 and <= 1024",)


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_gpu_memory_utilization_is_a_fraction(value: float) -> None:
    issue = issue_for(rejected(gpu_memory_utilization=value), "engine.gpu_memory_utilization")
    assert issue.accepted == ("a number > 0 and <= 1, or null",)


def test_unknown_keys_are_rejected_with_the_known_ones() -> None:
    error = rejected(tensor_parallel=2, speculative_decoding={"enabled": False, "drafts": 1})
    top = issue_for(error, "engine.tensor_parallel")
    assert "tensor_parallel_size" in top.accepted and top.value == 2
    nested = issue_for(error, "engine.speculative_decoding.drafts")
    assert "draft_model" in nested.accepted


def test_every_issue_is_reported_at_once_one_per_line() -> None:
    error = rejected(engine="tgi", dtype="int3", tensor_parallel_size=0, colour="red")
    assert len(error.issues) == 4 and len(error.lines()) == 4
    assert str(error).splitlines() == error.lines()
    assert all("(got " in line and "; accepted: " in line for line in error.lines())


def test_a_server_engine_needs_a_model() -> None:
    issue = issue_for(rejected(hf_model_id=None), "engine.hf_model_id")
    assert issue.value is None and "needs the model it serves" in issue.message
    parse_engine_block({"engine": "echo"})  # echo serves nothing
    parse_engine_block({"base_url": "http://gpu01:8000", "routing": "prefix"})  # already serving its model


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_spec_decode_enabled_without_its_draft_model_fails(method: str) -> None:
    error = rejected(speculative_decoding={"enabled": True, "method": method})
    issue = issue_for(error, "engine.speculative_decoding.draft_model")
    assert issue.value is None and f"method {method!r} needs a draft model" in issue.message


def test_spec_decode_defaults_to_the_draft_model_method() -> None:
    issue_for(rejected(speculative_decoding={"enabled": True}), "engine.speculative_decoding.draft_model")


def test_ngram_and_mtp_need_no_draft_model_and_take_none() -> None:
    for method in ("ngram", "mtp"):
        parse_engine_block({**BASE, "speculative_decoding": {"enabled": True, "method": method}})
    error = rejected(speculative_decoding={"enabled": True, "method": "ngram", "draft_model": "x/y"})
    assert issue_for(error, "engine.speculative_decoding.draft_model").accepted == ("null",)


def test_disabled_spec_decode_may_omit_the_draft_model() -> None:
    parse_engine_block({**BASE, "speculative_decoding": {"enabled": False}})


def test_prompt_lookup_is_ngram_only_and_ordered() -> None:
    error = rejected(speculative_decoding={"method": "eagle", "draft_model": "x", "prompt_lookup_max": 3})
    issue_for(error, "engine.speculative_decoding.prompt_lookup_max")
    error = rejected(speculative_decoding={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    issue = issue_for(error, "engine.speculative_decoding.prompt_lookup_min")
    assert issue.value == 5 and issue.accepted == ("an integer from 1 to 2",)


@pytest.mark.parametrize("modality", ["vision", "audio", "video"])
def test_a_media_modality_without_a_per_prompt_limit_fails(modality: str) -> None:
    error = rejected(multimodal={"modality": modality})
    issue = issue_for(error, "engine.multimodal.limit_mm_per_prompt")
    assert issue.value == {} and "denial-of-service" in issue.message


def test_limits_only_for_served_media_and_at_least_one_positive() -> None:
    error = rejected(multimodal={"modality": "vision", "limit_mm_per_prompt": {"image": 2, "audio": 1}})
    assert issue_for(error, "engine.multimodal.limit_mm_per_prompt.audio").accepted == ("{image: <count>}",)
    error = rejected(multimodal={"modality": "vision", "limit_mm_per_prompt": {"image": 0}})
    issue_for(error, "engine.multimodal.limit_mm_per_prompt")
    error = rejected(multimodal={"modality": "vision", "limit_mm_per_prompt": {"image": -1}})
    assert issue_for(error, "engine.multimodal.limit_mm_per_prompt.image").value == -1


@pytest.mark.parametrize(
    "domain", ["https://example.com", "*.example.com", "example.com:443", "169.254.169.254", "localhost"]
)
def test_media_domains_are_bare_public_host_names(domain: str) -> None:
    error = rejected(multimodal={"modality": "vision", "limit_mm_per_prompt": {"image": 1},
                                 "allowed_media_domains": ["ok.example.org", domain]})
    assert issue_for(error, "engine.multimodal.allowed_media_domains.1").value == domain


@pytest.mark.parametrize("path", ["data/media", "/", "/data/../etc"])
def test_local_media_path_is_a_confined_absolute_directory(path: str) -> None:
    error = rejected(multimodal={"allowed_local_media_path": path})
    assert issue_for(error, "engine.multimodal.allowed_local_media_path").value == path


def test_multimodal_policy_alone_enforces_its_rules() -> None:
    with pytest.raises(ValidationError, match="limit_mm_per_prompt"):
        MultimodalPolicy(modality="vision")
    assert MultimodalPolicy(modality="vision", limit_mm_per_prompt={"image": 2}).media_kinds == {"image"}


@pytest.mark.parametrize(("dtype", "methods"), [("int4", "awq"), ("int8", "gptq")])
def test_integer_dtypes_need_the_quantization_that_made_them(dtype: str, methods: str) -> None:
    issue = issue_for(rejected(dtype=dtype), "engine.quantization")
    assert issue.value is None and f"names {dtype} weights" in issue.message
    assert methods in issue.accepted
    block = parse_engine_block({**BASE, "dtype": dtype, "quantization": methods})
    assert (block.engine_dtype, block.effective_quantization) == ("auto", methods)


def test_fp8_dtype_means_fp8_quantization() -> None:
    block = parse_engine_block({**BASE, "dtype": "fp8"})
    assert (block.engine_dtype, block.effective_quantization) == ("auto", "fp8")
    issue = issue_for(rejected(dtype="fp8", quantization="awq"), "engine.quantization")
    assert issue.value == "awq" and "fp8" in issue.accepted


def test_unknown_quantization_lists_the_accepted_ones_and_null() -> None:
    issue = issue_for(rejected(quantization="bnb4"), "engine.quantization")
    assert issue.value == "bnb4" and {"awq", "gptq", "fp8", "null"} <= set(issue.accepted)


@pytest.mark.parametrize(
    ("args", "where", "says"),
    [
        (["--tensor-parallel-size", "2"], "0", "set by tensor_parallel_size"),
        (["--api-key=secret"], "0", "set by api_key_secret_ref"),
        (["--tensor_parallel_size", "2"], "0", "set by tensor_parallel_size"),
        (["--max-model", "99"], "0", "abbreviates --max-model-len"),
        (["--speculative-config.method", "ngram"], "0", "set by speculative_decoding"),
        (["--config", "x.yaml"], "0", "the engine block itself"),
        (["-tp", "2"], "0", "short options are not accepted"),
        (["8"], "0", "value with no flag"),
        (["--seed", "1", "--seed", "2"], "2", "given twice"),
        (["--bad flag"], "0", "not a flag name"),
    ],
)
def test_extra_args_cannot_bypass_the_schema(args: list[str], where: str, says: str) -> None:
    issue = issue_for(rejected(extra_args=args), f"engine.extra_args.{where}")
    assert says in issue.message and issue.value == args[int(where)]


def test_extra_args_are_for_engines_with_a_command_line() -> None:
    parse_engine_block({**BASE, "extra_args": ["--max-num-seqs", "8", "--enforce-eager"]})
    error = rejected(engine="echo", extra_args=["--seed", "1"])
    assert issue_for(error, "engine.extra_args").accepted == ("[] (empty)",)


def test_sglang_owns_its_own_flags() -> None:
    error = rejected(engine="sglang", extra_args=["--tp-size", "2", "--tensor-parallel-size", "2"])
    assert len(error.issues) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("hf_model_id", "-rf"), ("hf_model_id", "two words"), ("served_model_name", ""),
     ("base_url", "ftp://host"), ("base_url", "http://user@host:8000"),
     ("api_key_secret_ref", "vault://x y")],
)
def test_values_that_would_break_a_command_line_or_leak_are_rejected(field: str, value: str) -> None:
    assert issue_for(rejected(**{field: value}), f"engine.{field}").value == value


@pytest.mark.parametrize(("field", "fix"), [("base_url", "use api_key_secret_ref"),
                                            ("otlp_traces_endpoint", "put them in OTEL_EXPORTER_OTLP_HEADERS")])
def test_an_address_with_a_password_is_refused_without_echoing_it(field: str, fix: str) -> None:
    error = rejected(**{field: "http://ops:s3cret@gpu01:8000"})
    issue = issue_for(error, f"engine.{field}")
    assert issue.value == "http://ops:***@gpu01:8000" and f"carries credentials; {fix}" in str(error)
    assert "s3cret" not in str(error) and "s3cret" not in repr(error.issues)


@pytest.mark.parametrize("value", ["http://ops:s3cret@gpu01:port", "ftp://ops:s3cret@gpu01",
                                   "http://ops:s3cret@gpu01:8000/?q=1", "http://ops:s3cret@:8000"])
def test_a_malformed_address_is_refused_without_echoing_its_password(value: str) -> None:
    error = rejected(base_url=value)
    assert issue_for(error, "engine.base_url").value == value.replace("s3cret", "***")
    assert "s3cret" not in str(error)


def test_inproc_has_no_base_url() -> None:
    error = rejected(engine="vllm-inproc", base_url="http://gpu01:8000")
    assert issue_for(error, "engine.base_url").accepted == ("null",)


def test_a_non_mapping_block_is_an_issue_too() -> None:
    with pytest.raises(EngineBlockError) as caught:
        parse_engine_block("vllm")
    assert issue_for(caught.value, "engine").accepted == ("a mapping",)


def test_missing_values_and_errors_survive_pickling() -> None:
    error = EngineBlockError([EngineBlockIssue("engine.x", MISSING, "is required", ("a string",))])
    assert "(got (missing);" in str(error)
    assert pickle.loads(pickle.dumps(error)).lines() == error.lines()


def test_direct_construction_runs_the_same_rules() -> None:
    with pytest.raises(ValidationError, match="needs a draft model"):
        EngineBlock.model_validate({**BASE, "speculative_decoding": {"enabled": True}})
