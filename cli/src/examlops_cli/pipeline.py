"""`exa pipeline promote`: move a model alias to a verified version that cleared its eval gate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, console, emit_json, fail
from ._rpc import call
from ._versions import VerifyError, get_version, verify_here
from .models_versions import Ref, version_dict

app = typer.Typer(help="Promotion of model versions.", no_args_is_help=True)


@app.command()
def promote(
    ref: Ref,
    alias: Annotated[str, typer.Option(help="Alias to move, e.g. Production or Staging.")],
    force: Annotated[bool, typer.Option("--force", help="Skip the eval gate (never the signature); needs --reason, "
                                        "audited.")] = False,
    reason: Annotated[str, typer.Option(help="Why the gate is skipped (with --force).")] = "",
    path: Annotated[Path | None, typer.Option(help="Folder to re-hash; default: the registered path.")] = None,
) -> None:
    """Point ALIAS at NAME@V: its files must match its signed BOM here, and the registry re-checks the
    signature against the trusted keys and the latest eval gate."""
    if force and not reason.strip():
        fail("--force needs --reason: skipping the eval gate is audited with its reason")
    mv = get_version(ref)
    if mv.degraded:
        fail(f"not promoted: {mv.name}@{mv.version} is degraded ({mv.degraded_reason}): it was recorded, not "
             "produced, and cannot be served")
    try:
        verify_here(mv, path)
    except VerifyError as exc:
        fail(f"not promoted: {exc}")
    out = call("registry", "Promote", reg.PromoteRequest(name=mv.name, version=mv.version, alias=alias, force=force,
                                                         reason=reason, actor=Ctx.actor()))
    if Ctx.json:
        emit_json(version_dict(out))
        return
    forced = " (eval gate skipped: forced)" if force else ""
    console.print(f"{out.name}@{alias} → {out.name}@{out.version}{forced}")
