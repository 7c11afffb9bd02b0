"""A StartRequest checked and turned into a LaunchSpec: the block with the request's overrides."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import grpc

from examlops.engine import EngineBlockError, parse_engine_block
from examlops.launcher.v1 import launcher_pb2 as pb

from ._adapters import LAUNCHERS, LaunchError, LaunchSpec

DEFAULT_SERVE_PORT = 8000


def launch_spec(request: pb.StartRequest) -> LaunchSpec:
    """Validate a start request; LaunchError (INVALID_ARGUMENT) names the flag to fix."""
    launcher = request.launcher or "external"
    if launcher not in LAUNCHERS:
        raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "unknown_launcher",
                          f"unknown launcher {launcher!r}; accepted: {', '.join(LAUNCHERS)}", "launcher")
    data: dict[str, Any] = {}
    if request.engine_block_json:
        try:
            data = json.loads(request.engine_block_json)
        except json.JSONDecodeError as exc:
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_engine_block",
                              f"engine block is not JSON: {exc}", "engine_block") from None
        if not isinstance(data, dict):
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_engine_block",
                              "engine block is not a JSON object", "engine_block")
    if request.hf_model:
        data["hf_model_id"] = request.hf_model
    if request.tensor_parallel_size:
        data["tensor_parallel_size"] = request.tensor_parallel_size
    if request.pipeline_parallel_size:
        data["pipeline_parallel_size"] = request.pipeline_parallel_size
    starts_a_server = launcher != "external"
    if starts_a_server:
        engine = data.get("engine", "vllm-server")
        if engine not in ("vllm", "vllm-server"):
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "engine_not_startable",
                              f"launcher {launcher!r} starts vLLM servers; engine {engine!r} has none to start "
                              "(use --launcher external)", "engine")
        if not data.get("hf_model_id"):
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "missing_hf_model",
                              f"launcher {launcher!r} needs the weights to serve: pass --hf-model "
                              "(e.g. Qwen/Qwen3-VL-8B-Instruct) or set hf_model_id in the model's pack file",
                              "hf_model")
        # The gateway asks for the endpoint by its name unless the block names the model otherwise.
        data.setdefault("served_model_name", request.name)
    block = None
    if data:
        try:
            block = parse_engine_block(data)
        except EngineBlockError as exc:
            raise LaunchError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_engine_block",
                              f"invalid engine block for {request.name!r}: {exc}", "engine_block") from None
    port = request.port
    if not port and block is not None and block.base_url:
        port = urlsplit(block.base_url).port or 0
    return LaunchSpec(
        name=request.name, launcher=launcher, block=block,
        block_json=json.dumps(block.model_dump(mode="json", exclude_none=True), sort_keys=True) if block else "",
        base_url=request.base_url, project=request.project, nodes=request.nodes or 1,
        gpus_per_node=request.gpus_per_node, partition=request.partition, walltime=request.walltime,
        port=port or DEFAULT_SERVE_PORT, actor=request.actor, model_version=request.model_version)
