"""`exa serve llm args` and `exa serve llm batch`: the engine block's argv, and offline batch scoring."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from examlops.engine import (
    EngineBlock,
    EngineBlockError,
    VllmVenvMissingError,
    parse_engine_block,
    render_sglang_command,
    render_vllm_command,
)
from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, console, emit_json, fail
from ._pack import pack_block
from ._rpc import call
from .serve_llm import Model, app


def resolve_block(model: str) -> EngineBlock:
    """The model's block from the use-case pack, else from its registered endpoint."""
    data = pack_block(model)
    if data is None:
        ep = call("registry", "GetEndpoint", reg.GetEndpointRequest(name=model))
        if not ep.engine_block_json:
            fail(f"endpoint {model!r} was registered without an engine block; nothing to render")
        data = json.loads(ep.engine_block_json)
    try:
        return parse_engine_block(data)
    except EngineBlockError as exc:
        fail(f"invalid engine block for {model!r}:\n{exc}")


@app.command()
def args(
    model: Model,
    weights: Annotated[str, typer.Option(help="Load from this path instead of hf_model_id.")] = "",
) -> None:
    """The exact argv the engine block renders (`vllm serve …`, or SGLang's launcher)."""
    block = resolve_block(model)
    try:
        if block.engine == "sglang":
            cmd: Any = render_sglang_command(block, model=weights or None)
        elif block.engine in ("vllm-server", "vllm-inproc"):
            server = block.model_copy(update={"engine": "vllm-server", "mode": "server"})
            cmd = render_vllm_command(server, model=weights or None)
        else:
            fail(f"engine {block.engine!r} runs inside engine-proxy and has no command line")
    except EngineBlockError as exc:
        fail(str(exc))
    if Ctx.json:
        emit_json(cmd.argv)
    else:
        console.print(cmd.shell(), highlight=False, markup=False, soft_wrap=True)
        if cmd.env:  # secrets such as the API key travel here, never on the command line
            console.print(f"[dim]environment: {', '.join(sorted(cmd.env))}[/]")


def _read_corpus(path: Path) -> list[dict[str, Any]]:
    """Every line checked before anything runs: one bad line names itself and nothing starts."""
    items: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        fail(f"--input {path}: {exc.strerror}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            fail(f"{path}:{n}: not JSON ({exc})")
        if not isinstance(item, dict) or not (isinstance(item.get("messages"), list)
                                              or isinstance(item.get("prompt"), str)):
            fail(f"{path}:{n}: each line needs 'messages' (a list of chat messages) or 'prompt' (a string)")
        item.setdefault("id", str(n))
        items.append(item)
    return items


@app.command()
def batch(
    model: Model,
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL: {id?, messages | prompt, max_tokens?}.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL results, one per input line.")],
    weights: Annotated[str, typer.Option(help="Load from this path instead of hf_model_id.")] = "",
    batch_size: Annotated[int, typer.Option(min=1, help="Requests handed to vLLM at once.")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1, help="Default answer length.")] = 128,
    resume: Annotated[bool, typer.Option("--resume", help="Skip ids already in --output.")] = False,
) -> None:
    """Score a fixed corpus with in-process vLLM (engine vllm-inproc), writing results as they come."""
    from examlops.engine import InprocWorker, InprocWorkerError

    block = resolve_block(model)
    if block.engine not in ("vllm-inproc", "vllm-server"):
        fail(f"engine {block.engine!r} cannot batch in-process; use a vllm or vllm-inproc block")
    items = _read_corpus(input)
    done: set[str] = set()
    if resume and output.exists():
        done = {str(orjson.loads(x)["id"]) for x in output.read_text().splitlines() if x.strip()}
    todo = [i for i in items if str(i["id"]) not in done]
    for item in todo:
        item.setdefault("max_tokens", max_tokens)

    async def run() -> tuple[int, float]:
        worker = InprocWorker(block, model=weights or None)
        errors = 0
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=Ctx.json) as progress:
            task = progress.add_task(f"loading {model} in-process", total=len(todo))
            await worker.start()
            progress.update(task, description=f"scoring with {model}")
            with output.open("ab" if resume else "wb") as out:
                try:
                    for start in range(0, len(todo), batch_size):
                        for res in await worker.generate_batch(todo[start:start + batch_size]):
                            errors += "error" in res
                            out.write(orjson.dumps(res) + b"\n")
                        out.flush()
                        progress.advance(task, len(todo[start:start + batch_size]))
                finally:
                    await worker.aclose()
        return errors, worker.load_s

    try:
        errors, load_s = asyncio.run(run())
    except (InprocWorkerError, VllmVenvMissingError) as exc:
        fail(str(exc))
    summary = {"model": model, "scored": len(todo), "skipped": len(items) - len(todo), "errors": errors,
               "output": str(output), "load_s": load_s}
    if Ctx.json:
        emit_json(summary)
    else:
        console.print(f"scored {len(todo)} item(s) ({summary['skipped']} skipped, {errors} errors) → {output}")
    if errors:
        raise SystemExit(1)
