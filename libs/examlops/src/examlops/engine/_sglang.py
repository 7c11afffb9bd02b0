"""Render an engine block as `python -m sglang.launch_server` (the SGLang engine, GPU hosts only).

Flag names follow SGLang's server arguments (`--model-path`, `--tp-size`, `--context-length`,
`--mem-fraction-static`, `--speculative-algorithm`, ...). Where SGLang cannot honour a part of
the block, rendering fails instead of dropping it: SGLang has no server-side per-prompt media
limit or media-domain allow-list, and takes its API key only on the command line.
"""

from __future__ import annotations

from ._errors import EngineBlockError, EngineBlockIssue
from ._render import SglangCommand, _listen_args, _model, _require_engine
from ._schema import EngineBlock

#: The block's quantization methods SGLang's `--quantization` also accepts.
SGLANG_QUANTIZATIONS: frozenset[str] = frozenset({
    "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "moe_wna16", "fp8",
    "modelopt", "modelopt_fp4", "mxfp4",
})
#: Block kv_cache_dtype -> SGLang spelling (vLLM's "fp8" is E4M3; SGLang has no float16 cache).
SGLANG_KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
    "bfloat16": "bfloat16",
}
#: Block speculative method -> SGLang `--speculative-algorithm`.
SGLANG_SPECULATIVE_ALGORITHMS: dict[str, str] = {
    "draft_model": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "NEXTN",
    "ngram": "NGRAM",
}


def render_sglang_command(
    block: EngineBlock,
    *,
    model: str | None = None,
    host: str | None = None,
    port: int | None = None,
    python: str = "python",
) -> SglangCommand:
    """Render `block` (engine: sglang) as an SGLang launch; raises EngineBlockError when SGLang
    cannot carry out part of it."""
    _require_engine(block, "sglang", "render_sglang_command")
    issues = _unsupported(block)
    if issues:
        raise EngineBlockError(issues)
    argv = [python, "-m", "sglang.launch_server", "--model-path", _model(block, model)]
    if block.served_model_name is not None:
        argv += ["--served-model-name", block.served_model_name]
    argv += _listen_args(block, host, port)
    argv += ["--dtype", block.engine_dtype]
    if (quantization := block.effective_quantization) is not None:
        argv += ["--quantization", quantization]
    if block.max_model_len is not None:
        argv += ["--context-length", str(block.max_model_len)]
    argv += ["--tp-size", str(block.tensor_parallel_size)]
    argv += ["--pp-size", str(block.pipeline_parallel_size)]
    if block.gpu_memory_utilization is not None:
        argv += ["--mem-fraction-static", repr(block.gpu_memory_utilization)]
    if block.kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", SGLANG_KV_CACHE_DTYPES[block.kv_cache_dtype]]
    if block.enable_chunked_prefill is False:
        argv += ["--chunked-prefill-size", "-1"]
    if block.prefix_cache is False:
        argv += ["--disable-radix-cache"]
    argv += _speculative_args(block)
    argv += block.extra_args
    return SglangCommand(argv=argv)


def _speculative_args(block: EngineBlock) -> list[str]:
    spec = block.speculative_decoding
    if spec is None or not spec.enabled:
        return []
    args = ["--speculative-algorithm", SGLANG_SPECULATIVE_ALGORITHMS[spec.method]]
    if spec.method == "ngram":
        return [*args, "--speculative-num-draft-tokens", str(spec.num_speculative_tokens)]
    if spec.draft_model is not None:
        args += ["--speculative-draft-model-path", spec.draft_model]
    # A chain of k drafted tokens: k steps, one candidate each, k + 1 tokens verified.
    steps = spec.num_speculative_tokens
    return [
        *args,
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(steps + 1),
    ]


def _unsupported(block: EngineBlock) -> list[EngineBlockIssue]:
    issues: list[EngineBlockIssue] = []
    quantization = block.effective_quantization
    if quantization is not None and quantization not in SGLANG_QUANTIZATIONS:
        issues.append(EngineBlockIssue(
            "engine.quantization", quantization, "SGLang has no such quantization method",
            tuple(sorted(SGLANG_QUANTIZATIONS)),
        ))
    if block.kv_cache_dtype is not None and block.kv_cache_dtype not in SGLANG_KV_CACHE_DTYPES:
        issues.append(EngineBlockIssue(
            "engine.kv_cache_dtype", block.kv_cache_dtype, "SGLang has no such KV-cache dtype",
            tuple(SGLANG_KV_CACHE_DTYPES),
        ))
    spec = block.speculative_decoding
    if spec is not None and spec.enabled and spec.method == "ngram":
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(spec, name) is not None:
                issues.append(EngineBlockIssue(
                    f"engine.speculative_decoding.{name}", getattr(spec, name),
                    "SGLang's ngram drafter has no prompt-lookup window", ("null",),
                ))
    if block.multimodal.media_kinds:
        issues.append(EngineBlockIssue(
            "engine.multimodal.modality", block.multimodal.modality,
            "SGLang cannot enforce limit_mm_per_prompt or allowed_media_domains server-side; "
            "serve media models with vLLM", ("text",),
        ))
    if block.api_key_secret_ref is not None:
        issues.append(EngineBlockIssue(
            "engine.api_key_secret_ref", block.api_key_secret_ref,
            "SGLang takes its API key only on the command line, where ps shows it", ("null",),
        ))
    return issues
