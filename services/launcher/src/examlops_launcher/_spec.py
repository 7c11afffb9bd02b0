"""A StartRequest checked and turned into a LaunchSpec: the block with the request's overrides."""

from __future__ import annotations

import json
import re
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
    count, urls = pool_of(request, launcher)
    return LaunchSpec(
        name=request.name, launcher=launcher, block=block,
        block_json=json.dumps(block.model_dump(mode="json", exclude_none=True), sort_keys=True) if block else "",
        base_url=urls[0] if urls else request.base_url, project=request.project, nodes=request.nodes or 1,
        gpus_per_node=request.gpus_per_node, partition=request.partition, walltime=request.walltime,
        port=port or DEFAULT_SERVE_PORT, actor=request.actor, model_version=request.model_version,
        replica_ids=tuple(f"r{i}" for i in range(count)), base_urls=urls)


def _invalid(reason: str, message: str, param: str) -> LaunchError:
    return LaunchError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, param)


def pool_of(request: pb.StartRequest, launcher: str) -> tuple[int, tuple[str, ...]]:
    """(replicas, external base URLs): base_url, when set, is the first URL; one URL per replica."""
    if request.replicas < 0:
        raise _invalid("invalid_replicas", f"--replicas must be 1 or more (got {request.replicas})", "replicas")
    urls = [u.rstrip("/") for u in request.base_urls if u.strip()]
    if request.base_url and (not urls or urls[0] != request.base_url.rstrip("/")):
        urls.insert(0, request.base_url.rstrip("/"))
    if launcher != "external":
        if len(urls) > 1:
            raise _invalid("base_urls_not_startable",
                           f"launcher {launcher!r} starts its own servers; --base-url per replica is for "
                           "--launcher external (add a server to a live pool: exa serve llm replica add "
                           f"{request.name} --base-url URL)", "base_urls")
        return request.replicas or 1, ()
    for url in urls:
        if not re.match(r"^https?://[^\s/]+", url):
            raise _invalid("invalid_base_url", f"base URL {url!r} must be an http(s) URL like http://host:8000",
                           "base_urls")
    if len(set(urls)) != len(urls):
        raise _invalid("duplicate_base_url", "the same --base-url is given twice: one per replica", "base_urls")
    if request.replicas and urls and request.replicas != len(urls):
        raise _invalid("replicas_mismatch",
                       f"--replicas {request.replicas} but {len(urls)} --base-url given: the external launcher "
                       "takes one --base-url per replica", "base_urls")
    if request.replicas > 1 and not urls:
        raise _invalid("replicas_mismatch",
                       f"--replicas {request.replicas} with --launcher external needs one --base-url per replica",
                       "base_urls")
    return max(len(urls), 1), tuple(urls)
