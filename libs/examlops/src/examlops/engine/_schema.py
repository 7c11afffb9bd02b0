"""The per-model `engine:` block: which runtime serves a model, and how it is launched."""

from __future__ import annotations

import json
import re
import typing
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from examlops.urlmask import redact

from ._errors import EngineBlockError, EngineBlockIssue
from ._flags import SGLANG_OWNED_FLAGS, VLLM_OWNED_FLAGS, extra_args_issues
from ._multimodal import MultimodalPolicy

EngineName = Literal["vllm", "vllm-server", "vllm-inproc", "sglang", "echo"]
EngineMode = Literal["server", "inproc"]
DType = Literal["auto", "float16", "bfloat16", "float32", "int8", "int4", "fp8"]
Quantization = Literal[
    "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "moe_wna16",
    "fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "modelopt", "modelopt_fp4",
    "mxfp4", "experts_int8",
]
KvCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]
SpeculativeMethod = Literal["draft_model", "ngram", "eagle", "eagle3", "mtp"]
Task = Literal["generate", "embed"]
#: How engine-proxy spreads an endpoint's requests over its replicas (not a server flag).
Routing = Literal["least-load", "prefix", "session", "round-robin"]

ENGINES: tuple[str, ...] = typing.get_args(EngineName)
#: Spellings that mean another engine; the block stores the canonical name.
ENGINE_ALIASES: dict[str, str] = {"vllm": "vllm-server"}
DTYPES: tuple[str, ...] = typing.get_args(DType)
QUANTIZATIONS: tuple[str, ...] = typing.get_args(Quantization)
KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KvCacheDType)
SPECULATIVE_METHODS: tuple[str, ...] = typing.get_args(SpeculativeMethod)
TASKS: tuple[str, ...] = typing.get_args(Task)
ROUTINGS: tuple[str, ...] = typing.get_args(Routing)
#: Engines that serve `task: embed` (vLLM's pooling server, and echo's deterministic vectors).
EMBED_ENGINES: tuple[str, ...] = ("vllm-server", "echo")
#: Methods whose drafts come from a separate model (an EAGLE head counts as one).
DRAFT_MODEL_METHODS: frozenset[str] = frozenset({"draft_model", "eagle", "eagle3"})

#: The spec dtypes that are not a `--dtype` of vLLM or SGLang (both take auto, float16,
#: bfloat16, float32). Each names weights stored at that width, which is a quantization method
#: of the checkpoint: the block renders `--dtype auto --quantization <method>`. fp8 alone means
#: vLLM's dynamic FP8 quantization of a 16-bit checkpoint (`--quantization fp8`); int4 and int8
#: have no such on-the-fly method for dense models, so they need the method that produced the
#: checkpoint and are refused without one.
QUANTIZATION_FOR_DTYPE: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "compressed-tensors",
            "modelopt"),
    "int4": ("awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "moe_wna16"),
    "int8": ("gptq", "gptq_marlin", "compressed-tensors", "experts_int8"),
}
_DEFAULT_QUANTIZATION_FOR_DTYPE: dict[str, str] = {"fp8": "fp8"}

_TOKEN_ACCEPTED = ("a non-empty string without whitespace that does not start with '-'",)
_SECRET_REF = re.compile(r"^(env:)?[A-Za-z_][A-Za-z0-9_]*$")


def _check_token(value: str) -> str:
    """A value that goes onto a command line as one argument: never empty, never a flag."""
    if not value or value.startswith("-") or any(c.isspace() or not c.isprintable() for c in value):
        raise EngineBlockError.single("", value, "cannot be a command-line value", _TOKEN_ACCEPTED)
    return value


ArgToken = Annotated[str, AfterValidator(_check_token)]


class SpeculativeDecoding(BaseModel):
    """Opt-in speculative decoding; rendered as vLLM's `--speculative-config` JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = False
    method: SpeculativeMethod = "draft_model"
    draft_model: ArgToken | None = None
    num_speculative_tokens: int = Field(default=3, ge=1, le=64)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)

    @property
    def needs_draft_model(self) -> bool:
        return self.method in DRAFT_MODEL_METHODS

    @model_validator(mode="after")
    def _method_rules(self) -> SpeculativeDecoding:
        issues: list[EngineBlockIssue] = []
        if self.enabled and self.needs_draft_model and self.draft_model is None:
            issues.append(EngineBlockIssue(
                "draft_model", None,
                f"speculative decoding method {self.method!r} needs a draft model "
                "(or use method: ngram, which needs none)",
                ("a Hugging Face model id or a local path",),
            ))
        if not self.needs_draft_model and self.draft_model is not None:
            issues.append(EngineBlockIssue(
                "draft_model", self.draft_model,
                f"method {self.method!r} drafts without a draft model", ("null",),
            ))
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if self.method != "ngram" and getattr(self, name) is not None:
                issues.append(EngineBlockIssue(
                    name, getattr(self, name), "only method 'ngram' looks prompts up", ("null",),
                ))
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            issues.append(EngineBlockIssue(
                "prompt_lookup_min", low, f"is above prompt_lookup_max ({high})",
                (f"an integer from 1 to {high}",),
            ))
        if issues:
            raise EngineBlockError(issues)
        return self


def server_url(value: str, for_credentials: str) -> str:
    """`value` as a server address: http(s)://host[:port][/path], without trailing slash; EngineBlockError
    (field "") otherwise. A password in it is masked in the error; `for_credentials` says where it goes."""
    accepted = ("http(s)://host[:port][/path] without credentials, query or fragment",)
    shown = redact(value)  # what every refusal below shows: never a password
    try:
        url = urlsplit(value)
        port = url.port
    except ValueError as exc:
        raise EngineBlockError.single("", shown, f"is not a URL ({redact(str(exc))})", accepted) from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise EngineBlockError.single("", shown, "is not an http(s) URL", accepted)
    if url.username is not None or url.password is not None:
        raise EngineBlockError.single("", shown, f"carries credentials; {for_credentials}", accepted)
    if url.query or url.fragment or port == 0:
        raise EngineBlockError.single("", shown, "is not a server address", accepted)
    return value.rstrip("/")


class EngineBlock(BaseModel):
    """The `engine:` block of `usecases/<pack>/models/<name>.yaml`.

    `engine: vllm` is stored as `vllm-server`; `mode` defaults to `inproc` for `vllm-inproc` and
    to `server` otherwise. `task` says what the endpoint serves: `generate` (chat and completions)
    or `embed` (`/v1/embeddings`, vLLM's pooling runner). `routing` is how engine-proxy picks a
    replica of the endpoint's pool per request (`least-load`, `prefix`, `session`, `round-robin`);
    it renders no flag. Unset tuning fields (None) leave the engine's own default in place.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    engine: EngineName = "vllm-server"
    mode: EngineMode = "server"
    task: Task = "generate"
    routing: Routing = "least-load"
    base_url: str | None = None
    hf_model_id: ArgToken | None = None
    served_model_name: ArgToken | None = None
    dtype: DType = "auto"
    quantization: Quantization | None = None
    max_model_len: int | None = Field(default=None, ge=16)
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=1024)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    kv_cache_dtype: KvCacheDType | None = None
    enable_chunked_prefill: bool | None = None
    prefix_cache: bool | None = None
    speculative_decoding: SpeculativeDecoding | None = None
    multimodal: MultimodalPolicy = Field(default_factory=MultimodalPolicy)
    api_key_secret_ref: str | None = None
    #: Where vLLM exports its own request spans (`--otlp-traces-endpoint`); it joins the caller's trace
    #: through the `traceparent` engine-proxy sends. vLLM speaks OTLP/gRPC unless its environment has
    #: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (then the URL ends in /v1/traces).
    otlp_traces_endpoint: str | None = None
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _default_mode_from_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mode" not in data and data.get("engine") == "vllm-inproc":
            return {**data, "mode": "inproc"}
        return data

    @field_validator("engine")
    @classmethod
    def _canonical_engine(cls, value: str) -> str:
        return ENGINE_ALIASES.get(value, value)

    @field_validator("base_url")
    @classmethod
    def _base_url_is_an_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else server_url(value, "use api_key_secret_ref")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_endpoint_is_a_url(cls, value: str | None) -> str | None:
        return None if value is None else server_url(value, "put them in OTEL_EXPORTER_OTLP_HEADERS")

    @field_validator("api_key_secret_ref")
    @classmethod
    def _secret_ref_names_a_variable(cls, value: str | None) -> str | None:
        if value is not None and not _SECRET_REF.match(value):
            raise EngineBlockError.single(
                "", value, "is not a secret reference",
                ("NAME or env:NAME, the environment variable holding the key",),
            )
        return value

    @property
    def api_key_env_var(self) -> str | None:
        """The environment variable `api_key_secret_ref` names, if any."""
        ref = self.api_key_secret_ref
        return None if ref is None else ref.removeprefix("env:")

    @property
    def effective_quantization(self) -> str | None:
        """The quantization method the engine gets: the field, or the one `dtype` implies."""
        return self.quantization or _DEFAULT_QUANTIZATION_FOR_DTYPE.get(self.dtype)

    @property
    def engine_dtype(self) -> str:
        """The `--dtype` the engine gets: the spec dtype, or auto for a quantized width."""
        return "auto" if self.dtype in QUANTIZATION_FOR_DTYPE else self.dtype

    @model_validator(mode="after")
    def _cross_field_rules(self) -> EngineBlock:
        issues = [*self._engine_issues(), *self._task_issues(), *self._dtype_issues(),
                  *self._extra_args_issues()]
        if issues:
            raise EngineBlockError(issues)
        return self

    def _engine_issues(self) -> list[EngineBlockIssue]:
        issues: list[EngineBlockIssue] = []
        inproc = self.engine == "vllm-inproc"
        if inproc != (self.mode == "inproc"):
            wanted = "inproc" if inproc else "server"
            issues.append(EngineBlockIssue(
                "mode", self.mode,
                f"engine {self.engine!r} runs with mode {wanted!r} (only vllm-inproc runs "
                "in-process)", (wanted,),
            ))
        if self.otlp_traces_endpoint is not None and self.engine != "vllm-server":
            issues.append(EngineBlockIssue(
                "otlp_traces_endpoint", self.otlp_traces_endpoint,
                f"only a vLLM server exports its own spans here, not engine {self.engine!r}", ("null",),
            ))
        if inproc and self.base_url is not None:
            issues.append(EngineBlockIssue(
                "base_url", self.base_url, "an in-process engine has no server to reach", ("null",)
            ))
        # A block naming a server that already runs (an external endpoint) need not say what it serves.
        if self.engine != "echo" and self.hf_model_id is None and self.base_url is None:
            issues.append(EngineBlockIssue(
                "hf_model_id", None, f"engine {self.engine!r} needs the model it serves",
                ("a Hugging Face model id such as Qwen/Qwen3-VL-8B-Instruct",
                 "or the base_url of a server already running it"),
            ))
        return issues

    def _task_issues(self) -> list[EngineBlockIssue]:
        """What an embedding endpoint cannot have: it generates no tokens and reads only text."""
        if self.task != "embed":
            return []
        issues: list[EngineBlockIssue] = []
        if self.engine not in EMBED_ENGINES:
            issues.append(EngineBlockIssue(
                "task", self.task,
                f"engine {self.engine!r} does not serve embeddings here",
                ("generate", f"embed with engine {' or '.join(EMBED_ENGINES)}"),
            ))
        if self.speculative_decoding is not None and self.speculative_decoding.enabled:
            issues.append(EngineBlockIssue(
                "speculative_decoding.enabled", True,
                "an embedding model generates no tokens to draft (task: embed)", ("false",),
            ))
        if self.multimodal.modality != "text":
            issues.append(EngineBlockIssue(
                "multimodal.modality", self.multimodal.modality,
                "embedding endpoints embed text or token ids only (task: embed)", ("text",),
            ))
        return issues

    def _dtype_issues(self) -> list[EngineBlockIssue]:
        methods = QUANTIZATION_FOR_DTYPE.get(self.dtype)
        if methods is None or self.effective_quantization in methods:
            return []
        if self.quantization is None:
            message = (f"dtype {self.dtype!r} is not an engine dtype: it names {self.dtype} "
                       "weights, so set quantization to the method that produced the checkpoint")
            return [EngineBlockIssue("quantization", None, message, methods)]
        message = f"quantization {self.quantization!r} does not store {self.dtype} weights"
        return [EngineBlockIssue("quantization", self.quantization, message, methods)]

    def _extra_args_issues(self) -> list[EngineBlockIssue]:
        if not self.extra_args:
            return []
        if self.engine in ("echo", "vllm-inproc"):
            return [EngineBlockIssue(
                "extra_args", list(self.extra_args),
                f"engine {self.engine!r} has no command line", ("[] (empty)",),
            )]
        owned = SGLANG_OWNED_FLAGS if self.engine == "sglang" else VLLM_OWNED_FLAGS
        return [i.under("extra_args") for i in extra_args_issues(self.extra_args, owned)]


def _block_data(engine_block_json: str) -> dict[str, Any]:
    try:
        data = json.loads(engine_block_json) if engine_block_json else None
    except (TypeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def routing_of(engine_block_json: str) -> str:
    """The routing policy of an engine block stored as JSON; `least-load` when unset or unknown
    (never raises: the registry only stores validated blocks)."""
    value = _block_data(engine_block_json).get("routing")
    return value if value in ROUTINGS else "least-load"


def task_of(engine_block_json: str) -> str:
    """The task (`generate` or `embed`) of an engine block stored as JSON, as the registry holds it.

    Cheap enough for the request path and never raises: an empty, malformed or task-less block
    is a `generate` endpoint (the registry only stores validated blocks, so this is a fallback,
    not a second validator).
    """
    return "embed" if _block_data(engine_block_json).get("task") == "embed" else "generate"
