"""`exa serve manifest <model>`: the KServe LLMInferenceService a kserve start would emit."""

from __future__ import annotations

from typing import Annotated

import orjson
import typer

from examlops.launcher.v1 import launcher_pb2 as la

from ._output import Ctx, emit_json
from ._pack import check_block, pack_block
from ._rpc import call


def manifest(
    model: Annotated[str, typer.Argument(help="Endpoint name; its engine block comes from the use-case pack.")],
    hf_model: Annotated[str, typer.Option(help="Weights to serve (overrides the block's hf_model_id).")] = "",
    nodes: Annotated[int, typer.Option(help="Nodes: more than one adds a worker pod template.")] = 1,
    gpus: Annotated[int, typer.Option(help="GPUs per node (pod).")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="Tensor parallel size; overrides the block.")] = 0,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline parallel size; overrides the block.")] = 0,
    project: Annotated[str, typer.Option(help="Project label.")] = "",
    alias: Annotated[str, typer.Option(help="Serve the version this alias of the model names (MODEL@ALIAS, "
                                       "e.g. Production): verified, then loaded from the cluster's model store.")] = "",
    model_version: Annotated[str, typer.Option(help="Serve this registered version, NAME@V or NAME@ALIAS.")] = "",
) -> None:
    """Print the LLMInferenceService for a model (nothing is applied or recorded)."""
    block = pack_block(model) or {}
    if hf_model:
        block["hf_model_id"] = hf_model
    ref = model_version or (f"{model}@{alias}" if alias else "")
    served = ""
    if ref:
        from ._versions import apply_version, servable_version

        mv = servable_version(ref, rehash=False)  # the cluster has the files; this host may not
        block, _ = apply_version(block, mv)
        served = f"{mv.name}@{mv.version}"
    if block:
        check_block(block)
    plan = call("launcher", "Plan", la.StartRequest(
        name=model, launcher="kserve", hf_model=hf_model, project=project, nodes=nodes, gpus_per_node=gpus,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, model_version=served,
        engine_block_json=orjson.dumps(block).decode() if block else ""))
    if Ctx.json:
        emit_json({"manifest": plan.manifest, "summary": plan.summary})
    else:
        typer.echo(plan.manifest, nl=False)
