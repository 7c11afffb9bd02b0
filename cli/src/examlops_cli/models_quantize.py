"""`exa models quantize` and `exa models methods`: a quantized version, produced by the real quantizer
where the host can run it, registered signed and BOM'd with its parent and the quantizer's parameters.
Where a method cannot run here, degraded mode records the transformation as provenance only: the
version is registered `degraded` with the reason, and `serve llm start` refuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from examlops.provenance import METHODS, QuantizeError, degraded_reason, quantizer_python, run_quantizer, servable_here

from ._output import Ctx, console, emit_json, err_console, fail, table
from ._versions import Registration, dataset_of, hashing, register, servable_version
from .models import app
from .models_versions import version_dict


def _calibration(name: str) -> str:
    m = METHODS[name]
    return "required" if m.needs_calibration else "optional" if m.accepts_calibration else "none"


@app.command()
def methods() -> None:
    """Quantization methods, whether this host can run the quantizer, and whether its vLLM can serve the result."""
    runs = quantizer_python() is not None
    rows = []
    for name, m in METHODS.items():
        ok, why = servable_here(name)
        rows.append({"method": name, "description": m.summary, "needs_calibration": m.needs_calibration,
                     "quantizer_here": runs, "servable_here": ok, "reason": why})
    if Ctx.json:
        emit_json(rows)
        return
    table("Quantization methods", ["method", "what", "calibration", "quantizer here", "servable here"],
          [[r["method"], r["description"], _calibration(str(r["method"])),
            "yes" if runs else "no: bash scripts/quant-env.sh", "yes" if r["servable_here"] else f"no: {r['reason']}"]
           for r in rows])


@app.command()
def quantize(
    name: Annotated[str, typer.Argument(help="Model name of the parent version.")],
    version: Annotated[str, typer.Argument(help="Parent version (or alias); the result is NAME@V-METHOD.")],
    method: Annotated[str, typer.Option(help="w8a8 | w4a16 | fp8 | gptq | awq (see `exa models methods`).")],
    path: Annotated[Path, typer.Option(help="Folder to write the quantized checkpoint to (must not exist).")],
    dataset: Annotated[str, typer.Option(help="Calibration set: a local text or JSONL file.")] = "",
    dataset_revision: Annotated[str, typer.Option(help="The calibration set's revision (recorded in the BOM).")] = "",
    samples: Annotated[int, typer.Option(help="Calibration texts used.", min=1)] = 32,
) -> None:
    """Quantize NAME@VERSION and register NAME@VERSION-METHOD, signed, with its parent and recipe in the BOM."""
    if method not in METHODS:
        fail(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        fail(f"{path} exists and is not empty: choose a new --path (nothing is overwritten)")
    parent = servable_version(f"{name}@{version}")  # the parent must be intact before anything derives from it
    calibration = dataset_of(dataset, dataset_revision, "calibration") if dataset else None
    if calibration is not None and not calibration.sha256:
        fail(f"--dataset {dataset}: not a local file (calibration sets are read from disk, never downloaded)")
    if METHODS[method].needs_calibration and calibration is None:
        fail(f"{method} needs a calibration set: pass --dataset FILE --dataset-revision R")
    if calibration is not None and not METHODS[method].accepts_calibration:
        fail(f"{method} is data-free: it takes no --dataset")
    quantization: dict[str, object] = {"method": method}
    tool_versions: dict[str, str] = {}
    degraded = degraded_reason()
    if not degraded:
        def show(line: str) -> None:
            if not Ctx.json:
                err_console.print(f"[dim]{escape(line)}[/]", highlight=False)

        try:
            result = run_quantizer(method, Path(parent.path), path, Path(dataset) if dataset else None,
                                   samples=samples if dataset else None, progress=show)
        except QuantizeError as exc:
            fail(f"quantization failed, nothing registered: {exc}")
        quantization |= {k: v for k, v in result.parameters().items() if k != "tools"}
        quantization["seconds"] = round(result.seconds, 1)
        tool_versions = dict(result.tools)
    else:
        err_console.print(f"[yellow]degraded:[/] {degraded}; the transformation is recorded, not run")
    reg_ = Registration(name=parent.name, version=f"{parent.version}-{method}", folder=path,
                        datasets=[calibration] if calibration else [], parent=parent, quantization=quantization,
                        degraded_reason=degraded, tool_versions=tool_versions, project=parent.project)
    with hashing(path, "hashing") as progress:
        mv = register(reg_, Ctx.actor(), progress)
    if Ctx.json:
        emit_json(version_dict(mv))
        return
    ok, why = servable_here(method)
    console.print(f"registered {mv.name}@{mv.version} from {parent.name}@{parent.version}: "
                  + (f"degraded ({mv.degraded_reason})" if mv.degraded else
                     f"{len(mv.files)} files, signed by {mv.key_id}; "
                     + ("this host's vLLM can serve it" if ok else f"this host cannot serve it: {why}")))
