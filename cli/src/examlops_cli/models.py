"""`exa models engine …`: validate engine blocks, list engines, check a whole pack (CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from examlops.engine import ENGINES, EngineBlockError, VllmVenvMissingError, load_model_file, require_vllm_python
from examlops.engine import validate_pack_dir as _validate_pack_dir

from ._output import Ctx, console, emit_json, fail, table

app = typer.Typer(help="Models and their engine blocks.", no_args_is_help=True)
engine_app = typer.Typer(help="The per-model `engine:` block.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")

ENGINE_PURPOSE = {
    "vllm-server": "Serving: client of a `vllm serve` process (text and vision). Alias: vllm.",
    "vllm-inproc": "Offline batch scoring of a fixed corpus in-process (`exa serve llm batch`).",
    "sglang": "Client of an SGLang server (RadixAttention, structured output).",
    "echo": "CPU dev and CI: deterministic, no dependencies.",
}


def _runs_here(engine: str) -> str:
    if engine != "vllm-inproc":
        return {"vllm-server": "yes, given a reachable server", "sglang": "yes, given a reachable server",
                "echo": "yes"}[engine]
    try:
        return f"yes, with {require_vllm_python()}"
    except VllmVenvMissingError:
        return "no: build the CPU vLLM environment with scripts/vllm-env.sh (or make up)"


@engine_app.command("list")
def list_engines() -> None:
    """Engines, what each is for, and whether it can run on this host."""
    rows = [{"engine": e, "purpose": ENGINE_PURPOSE[e], "runs_here": _runs_here(e)}
            for e in ENGINES if e in ENGINE_PURPOSE]
    if Ctx.json:
        emit_json(rows)
        return
    table("Engines", ["engine", "purpose", "runs here"], [[r["engine"], r["purpose"], r["runs_here"]] for r in rows])


def _report(results: list[tuple[Path, EngineBlockError | None]]) -> None:
    bad = [(p, e) for p, e in results if e is not None]
    if Ctx.json:
        emit_json([{"file": str(p), "valid": e is None, "errors": e.lines() if e else []} for p, e in results])
    else:
        for path, err in results:
            if err is None:
                console.print(f"[green]ok[/]    {path}")
            else:
                console.print(f"[red]error[/] {path}")
                for line in err.lines():
                    console.print(f"      {line}", highlight=False, markup=False)
        console.print(f"{len(results) - len(bad)} valid, {len(bad)} invalid")
    if bad:
        raise SystemExit(1)


@engine_app.command()
def validate(files: Annotated[list[Path], typer.Argument(help="Model YAML files of a use-case pack.")]) -> None:
    """Validate model files; every error is listed; exit 1 when any file is invalid."""
    results: list[tuple[Path, EngineBlockError | None]] = []
    for path in files:
        if not path.is_file():
            fail(f"{path}: no such file")
        try:
            load_model_file(path)
        except EngineBlockError as exc:
            results.append((path, exc))
        else:
            results.append((path, None))
    _report(results)


@engine_app.command()
def check(
    directory: Annotated[Path, typer.Argument(help="A pack, a folder of packs, or a models/ folder.")],
    vllm_parser: Annotated[bool, typer.Option("--vllm-parser", help="Also parse every rendered argv with "
                                              "vLLM's own parser (needs the CPU vLLM environment).")] = False,
) -> None:
    """Registry-integrity check for CI: every model file of a pack validates (and renders)."""
    if not directory.is_dir():
        fail(f"{directory}: no such directory")
    if not vllm_parser:
        _report(_validate_pack_dir(directory))
        return
    from examlops.engine import VllmArgvChecker

    try:
        with VllmArgvChecker() as checker:
            _report(_validate_pack_dir(directory, vllm=checker))
    except VllmVenvMissingError as exc:
        fail(str(exc))
