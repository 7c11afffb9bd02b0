"""The ONE renderer of an engine block into a `vllm serve` command (and an SGLang launch).

Compose services, Slurm job templates, KServe manifests and `exa serve llm args` all call
`render_vllm_command`, so an engine block means the same thing on every substrate. Secrets
travel in `LaunchCommand.env`, never in `argv`, where `ps` would show them.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ._errors import EngineBlockError, EngineBlockIssue
from ._schema import EngineBlock, _check_token

#: Environment variable `vllm serve` reads its API key from.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: vLLM's `--allowed-media-domains` allows every domain when empty; the spec says an empty
#: allow-list denies all remote media, so it is rendered as this one name, which can never
#: resolve (RFC 2606 reserves `.invalid`).
DENY_ALL_MEDIA_DOMAINS = "remote-media-disabled.invalid"
_MIB = 1024 * 1024


@dataclass(frozen=True)
class LaunchCommand:
    """A process to start: its argv, and the environment it needs on top of the inherited one."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The argv quoted for a POSIX shell (the env is left out: it may hold secrets)."""
        return shlex.join(self.argv)

    def __repr__(self) -> str:
        env = {k: ("***" if k == VLLM_API_KEY_ENV else v) for k, v in self.env.items()}
        return f"{type(self).__name__}(argv={self.argv!r}, env={env!r})"


class VllmCommand(LaunchCommand):
    """`vllm serve <model> ...`."""


class SglangCommand(LaunchCommand):
    """`python -m sglang.launch_server --model-path <model> ...`."""


def render_vllm_command(
    block: EngineBlock,
    *,
    model: str | None = None,
    host: str | None = None,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> VllmCommand:
    """Render `block` as the `vllm serve` command that serves it.

    `model` replaces `hf_model_id` as what vLLM loads (e.g. a local folder of the same model);
    `port` defaults to the port of `base_url`. The API key is looked up in `environ` (default:
    os.environ) under the variable `api_key_secret_ref` names, and passed as VLLM_API_KEY.
    """
    _require_engine(block, "vllm-server", "render_vllm_command")
    argv = ["vllm", "serve", _model(block, model)]
    if block.served_model_name is not None:
        argv += ["--served-model-name", block.served_model_name]
    argv += _listen_args(block, host, port)
    if block.task == "embed":
        # The pooling runner serves /v1/embeddings; its --convert default (auto) keeps a native
        # embedding model (BertModel) as it is and adapts a generative checkpoint to embed.
        argv += ["--runner", "pooling"]
    argv += ["--dtype", block.engine_dtype]
    if (quantization := block.effective_quantization) is not None:
        argv += ["--quantization", quantization]
    if block.max_model_len is not None:
        argv += ["--max-model-len", str(block.max_model_len)]
    argv += ["--tensor-parallel-size", str(block.tensor_parallel_size)]
    argv += ["--pipeline-parallel-size", str(block.pipeline_parallel_size)]
    if block.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", repr(block.gpu_memory_utilization)]
    if block.kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", block.kv_cache_dtype]
    argv += _bool_flag("enable-chunked-prefill", block.enable_chunked_prefill)
    argv += _bool_flag("enable-prefix-caching", block.prefix_cache)
    if (spec := vllm_speculative_config(block)) is not None:
        argv += ["--speculative-config", _json(spec)]
    argv += _vllm_multimodal_args(block)
    if block.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", block.otlp_traces_endpoint]
    argv += block.extra_args
    return VllmCommand(argv=argv, env={**_vllm_media_env(block), **_api_key_env(block, environ)})


def vllm_speculative_config(block: EngineBlock) -> dict[str, Any] | None:
    """The `--speculative-config` object for `block`, or None when spec decode is off."""
    spec = block.speculative_decoding
    if spec is None or not spec.enabled:
        return None
    config: dict[str, Any] = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
    }
    if spec.draft_model is not None:
        config["model"] = spec.draft_model
    if spec.prompt_lookup_max is not None:
        config["prompt_lookup_max"] = spec.prompt_lookup_max
    if spec.prompt_lookup_min is not None:
        config["prompt_lookup_min"] = spec.prompt_lookup_min
    return config


def _vllm_multimodal_args(block: EngineBlock) -> list[str]:
    policy = block.multimodal
    if not policy.media_kinds:
        return []
    args = ["--limit-mm-per-prompt", _json(dict(policy.limit_mm_per_prompt))]
    args += ["--allowed-media-domains", *(policy.allowed_media_domains or [DENY_ALL_MEDIA_DOMAINS])]
    if policy.allowed_local_media_path is not None:
        args += ["--allowed-local-media-path", policy.allowed_local_media_path]
    if policy.mm_processor_cache_gb is not None:
        args += ["--mm-processor-cache-gb", repr(policy.mm_processor_cache_gb)]
    return args


def _vllm_media_env(block: EngineBlock) -> dict[str, str]:
    """Server-side media limits vLLM only takes from its environment."""
    policy = block.multimodal
    if not policy.media_kinds:
        return {}
    # A redirect would let an allowed host send vLLM's fetcher anywhere (an SSRF bypass).
    env = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
    if policy.modality == "vision":
        # vLLM caps each remote download in whole MiB; round up so no valid image is refused.
        env["VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB"] = str(math.ceil(policy.max_image_bytes / _MIB))
    return env


def _api_key_env(block: EngineBlock, environ: Mapping[str, str] | None) -> dict[str, str]:
    variable = block.api_key_env_var
    if variable is None:
        return {}
    source = os.environ if environ is None else environ
    key = source.get(variable)
    if not key:
        raise EngineBlockError.single(
            "engine.api_key_secret_ref", block.api_key_secret_ref,
            f"the environment variable {variable} holding the API key is not set",
            (f"{variable} set in the launcher's environment (by the secrets store)",),
        )
    return {VLLM_API_KEY_ENV: key}


def _require_engine(block: EngineBlock, engine: str, renderer: str) -> None:
    if block.engine != engine:
        raise EngineBlockError.single(
            "engine.engine", block.engine, f"{renderer} renders engine {engine!r} only", (engine,)
        )


def _model(block: EngineBlock, model: str | None) -> str:
    chosen = model if model is not None else block.hf_model_id
    if chosen is None:
        raise EngineBlockError.single(
            "engine.hf_model_id", None, "nothing to serve", ("a model id or a local folder",)
        )
    try:
        return _check_token(chosen)
    except EngineBlockError as exc:
        raise EngineBlockError(i.under("model") for i in exc.issues) from None


def _listen_args(block: EngineBlock, host: str | None, port: int | None) -> list[str]:
    args: list[str] = []
    issues: list[EngineBlockIssue] = []
    if host is not None:
        try:
            args += ["--host", _check_token(host)]
        except EngineBlockError as exc:
            issues += [i.under("host") for i in exc.issues]
    if port is None and block.base_url is not None:
        port = urlsplit(block.base_url).port
    if port is not None:
        if isinstance(port, bool) or not 1 <= port <= 65535:
            issues.append(EngineBlockIssue("port", port, "is not a TCP port", ("1..65535",)))
        else:
            args += ["--port", str(port)]
    if issues:
        raise EngineBlockError(issues)
    return args


def _bool_flag(name: str, value: bool | None) -> list[str]:
    if value is None:
        return []
    return [f"--{name}"] if value else [f"--no-{name}"]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
