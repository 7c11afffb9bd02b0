"""Which command-line flags the engine block owns, and the check of the `extra_args` escape hatch.

A flag the schema owns must come from its field, never from `extra_args`: otherwise the same
setting could be given twice with the last one silently winning, or the API key could be put
on a command line where `ps` shows it. Aliases (`-tp`, `--device-memory-utilization`) and
prefixes argparse would expand (`--tensor-parallel`) count as the flag they stand for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ._errors import EngineBlockIssue

_BLOCK = "the engine block itself"

#: `vllm serve` flags (without the leading --) and the engine-block field that sets each one.
VLLM_OWNED_FLAGS: Mapping[str, str] = {
    "model": "hf_model_id",
    "served-model-name": "served_model_name",
    "host": "the renderer's host",
    "port": "base_url / the renderer's port",
    "runner": "task",
    "convert": "task",
    "dtype": "dtype",
    "quantization": "quantization",
    "quantization-config": "quantization",
    "max-model-len": "max_model_len",
    "tensor-parallel-size": "tensor_parallel_size",
    "pipeline-parallel-size": "pipeline_parallel_size",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "device-memory-utilization": "gpu_memory_utilization",
    "kv-cache-dtype": "kv_cache_dtype",
    "enable-chunked-prefill": "enable_chunked_prefill",
    "no-enable-chunked-prefill": "enable_chunked_prefill",
    "enable-prefix-caching": "prefix_cache",
    "no-enable-prefix-caching": "prefix_cache",
    "speculative-config": "speculative_decoding",
    "spec-method": "speculative_decoding",
    "spec-model": "speculative_decoding",
    "spec-tokens": "speculative_decoding",
    "limit-mm-per-prompt": "multimodal.limit_mm_per_prompt",
    "allowed-media-domains": "multimodal.allowed_media_domains",
    "allowed-local-media-path": "multimodal.allowed_local_media_path",
    "mm-processor-cache-gb": "multimodal.mm_processor_cache_gb",
    "api-key": "api_key_secret_ref (the key travels by environment, never on argv)",
    "otlp-traces-endpoint": "otlp_traces_endpoint",
    "config": _BLOCK,
}

#: `python -m sglang.launch_server` flags and the field that sets each one.
SGLANG_OWNED_FLAGS: Mapping[str, str] = {
    "model-path": "hf_model_id",
    "model": "hf_model_id",
    "served-model-name": "served_model_name",
    "host": "the renderer's host",
    "port": "base_url / the renderer's port",
    "is-embedding": "task",
    "dtype": "dtype",
    "quantization": "quantization",
    "context-length": "max_model_len",
    "tp-size": "tensor_parallel_size",
    "tp": "tensor_parallel_size",
    "tensor-parallel-size": "tensor_parallel_size",
    "pp-size": "pipeline_parallel_size",
    "pipeline-parallel-size": "pipeline_parallel_size",
    "mem-fraction-static": "gpu_memory_utilization",
    "kv-cache-dtype": "kv_cache_dtype",
    "chunked-prefill-size": "enable_chunked_prefill",
    "disable-radix-cache": "prefix_cache",
    "speculative-algorithm": "speculative_decoding",
    "speculative-draft-model-path": "speculative_decoding",
    "speculative-draft-model": "speculative_decoding",
    "speculative-num-steps": "speculative_decoding",
    "speculative-eagle-topk": "speculative_decoding",
    "speculative-num-draft-tokens": "speculative_decoding",
    "enable-multimodal": "multimodal.modality",
    "api-key": "api_key_secret_ref (the key travels by environment, never on argv)",
    "config": _BLOCK,
}

_FLAG_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_NUMBER = re.compile(r"^-\d+(\.\d+)?$")
_ACCEPTED = ("long flags ('--name', '--name=value', '--name value ...') not set by a field",)


def extra_args_issues(args: Sequence[str], owned: Mapping[str, str]) -> list[EngineBlockIssue]:
    """Problems with `extra_args` as flags of an engine whose schema owns `owned`.

    Field paths are indexes into the list (``"2"``). The real engine parser is the final judge
    of the flags this lets through (see examlops.engine.VllmArgvChecker); this check keeps out
    what would contradict or bypass the schema, and what cannot be a flag sequence at all.
    """
    issues: list[EngineBlockIssue] = []
    seen: set[str] = set()
    after_flag = False
    for index, token in enumerate(args):
        where = str(index)
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
            if not _FLAG_NAME.match(name):
                issues.append(EngineBlockIssue(where, token, "is not a flag name", _ACCEPTED))
            elif (field := _owner(name, owned)) is not None:
                issues.append(EngineBlockIssue(
                    where, token, f"--{name} is set by {field}, not by extra_args", _ACCEPTED
                ))
            elif name in seen:
                issues.append(EngineBlockIssue(where, token, f"--{name} is given twice", _ACCEPTED))
            seen.add(name)
            after_flag = True
        elif token.startswith("-") and not _NUMBER.match(token):
            issues.append(EngineBlockIssue(
                where, token, "short options are not accepted; use the long --spelling", _ACCEPTED
            ))
        elif not after_flag or token == "":
            issues.append(EngineBlockIssue(where, token, "is a value with no flag before it", _ACCEPTED))
    return issues


def _owner(name: str, owned: Mapping[str, str]) -> str | None:
    """The field owning flag `name`, counting argparse's unambiguous-prefix expansion."""
    if name in owned:
        return owned[name]
    for flag, field in owned.items():
        if flag.startswith(name):
            return f"{field} (--{name} abbreviates --{flag})"
    return None
