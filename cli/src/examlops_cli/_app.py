"""The `exa` root command."""

from __future__ import annotations

import sys

import typer

from . import (
    audit,
    challenger,
    dev,
    gateway,
    gateway_cache,
    gateway_guardrail,
    hpc,
    manifest,
    models,
    models_eval,
    models_quantize,
    models_versions,
    pipeline,
    rag,
    serve_llm,
    serve_llm_bench,
    serve_llm_engine,
    serve_llm_pool,
)
from ._output import Ctx

app = typer.Typer(
    help="ExaMLOps serving plane: start vLLM endpoints anywhere, route them through one gateway.\n\n"
         "Every command takes --json for machine-readable output.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
serve = typer.Typer(help="Serving endpoints.", no_args_is_help=True)
serve.add_typer(serve_llm.app, name="llm")
serve.command("manifest")(manifest.manifest)
serve.add_typer(challenger.app, name="challenger")
app.add_typer(serve, name="serve")
app.add_typer(hpc.app, name="hpc")
gateway.app.add_typer(gateway_guardrail.app, name="guardrail")
gateway.app.add_typer(gateway_cache.app, name="cache")
app.add_typer(gateway.app, name="gateway")
app.add_typer(audit.app, name="audit")
app.add_typer(dev.app, name="dev")
app.add_typer(models.app, name="models")
app.add_typer(pipeline.app, name="pipeline")
app.add_typer(rag.app, name="rag")

# These attach their commands to `exa serve llm` and `exa models`.
del serve_llm_bench, serve_llm_engine, serve_llm_pool, models_versions, models_eval, models_quantize


def main() -> None:
    """`--json` is accepted anywhere on the line (`exa --json serve llm list` or `… list --json`)."""
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    if "--json" in argv[:cut]:
        Ctx.json = True
        argv = [a for i, a in enumerate(argv) if not (a == "--json" and i < cut)]
    app(args=argv, prog_name="exa")
