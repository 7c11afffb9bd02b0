"""Engine blocks: the per-model `engine:` schema, its one renderer, and use-case pack loading.

    spec = find_model("qwen-vl")                       # usecases/<pack>/models/qwen-vl.yaml
    command = render_vllm_command(spec.engine, port=8000)
    subprocess.Popen(command.argv, env={**os.environ, **command.env})
"""

from ._errors import MISSING, EngineBlockError, EngineBlockIssue
from ._flags import SGLANG_OWNED_FLAGS, VLLM_OWNED_FLAGS
from ._inproc import InprocWorker, InprocWorkerError
from ._multimodal import MODALITY_MEDIA, MediaKind, Modality, MultimodalPolicy
from ._pack import (
    USECASE_DIR_ENV,
    ModelNotFoundError,
    ModelSpec,
    find_model,
    find_model_file,
    load_model_file,
    parse_engine_block,
    parse_model_spec,
    validate_pack_dir,
)
from ._render import (
    DENY_ALL_MEDIA_DOMAINS,
    VLLM_API_KEY_ENV,
    LaunchCommand,
    SglangCommand,
    VllmCommand,
    render_vllm_command,
    vllm_speculative_config,
)
from ._schema import (
    DTYPES,
    EMBED_ENGINES,
    ENGINE_ALIASES,
    ENGINES,
    KV_CACHE_DTYPES,
    QUANTIZATION_FOR_DTYPE,
    QUANTIZATIONS,
    ROUTINGS,
    SPECULATIVE_METHODS,
    TASKS,
    EngineBlock,
    SpeculativeDecoding,
    routing_of,
    server_url,
    task_of,
)
from ._sglang import render_sglang_command
from ._vllm_check import (
    VLLM_VENV_ENV,
    ParsedArgv,
    VllmArgvChecker,
    VllmVenvMissingError,
    cached_venv_dir,
    require_vllm_python,
    vllm_venv_dir,
)

__all__ = [
    "DENY_ALL_MEDIA_DOMAINS",
    "DTYPES",
    "EMBED_ENGINES",
    "ENGINES",
    "ENGINE_ALIASES",
    "KV_CACHE_DTYPES",
    "MISSING",
    "MODALITY_MEDIA",
    "QUANTIZATIONS",
    "QUANTIZATION_FOR_DTYPE",
    "ROUTINGS",
    "SGLANG_OWNED_FLAGS",
    "SPECULATIVE_METHODS",
    "TASKS",
    "USECASE_DIR_ENV",
    "VLLM_API_KEY_ENV",
    "VLLM_OWNED_FLAGS",
    "VLLM_VENV_ENV",
    "EngineBlock",
    "EngineBlockError",
    "EngineBlockIssue",
    "InprocWorker",
    "InprocWorkerError",
    "LaunchCommand",
    "MediaKind",
    "Modality",
    "ModelNotFoundError",
    "ModelSpec",
    "MultimodalPolicy",
    "ParsedArgv",
    "SglangCommand",
    "SpeculativeDecoding",
    "VllmArgvChecker",
    "VllmCommand",
    "VllmVenvMissingError",
    "cached_venv_dir",
    "find_model",
    "find_model_file",
    "load_model_file",
    "parse_engine_block",
    "parse_model_spec",
    "render_sglang_command",
    "render_vllm_command",
    "require_vllm_python",
    "routing_of",
    "server_url",
    "task_of",
    "validate_pack_dir",
    "vllm_speculative_config",
    "vllm_venv_dir",
]
