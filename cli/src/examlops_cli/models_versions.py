"""`exa models keygen|trust|register|versions|bom|verify`: signed, BOM'd model versions."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Annotated

import orjson
import typer

from examlops.provenance import SigningError, generate_keypair, key_id, load_public_pem
from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, console, emit_json, fail, message_dict, table
from ._rpc import call
from ._versions import (
    Registration,
    VerifyError,
    dataset_of,
    get_version,
    hashing,
    next_version,
    verify_here,
)
from ._versions import register as register_version
from .models import app

trust_app = typer.Typer(help="Public keys whose signatures the registry accepts.", no_args_is_help=True)
app.add_typer(trust_app, name="trust")

Ref = Annotated[str, typer.Argument(help="NAME@VERSION, or NAME@ALIAS (e.g. smol@Production).")]


def version_dict(mv: reg.ModelVersion) -> dict[str, object]:
    d = message_dict(mv)
    d.pop("bom_json", None)
    d["created_at_ms"] = mv.created_at_ms
    d["ref"] = f"{mv.name}@{mv.version}"
    d["evals"] = [message_dict(e) | {"time_ms": e.time_ms, "task_count": e.task_count} for e in mv.evals]
    return d


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def keygen(out: Annotated[Path, typer.Option(help="Folder for signing.key (private, 0600) and signing.pub.")]) -> None:
    """Create an Ed25519 signing key pair. Point EXAMLOPS_SIGNING_KEY at signing.key; trust signing.pub."""
    try:
        priv, pub, kid = generate_keypair(out)
    except SigningError as exc:
        fail(str(exc))
    if Ctx.json:
        emit_json({"private_key": str(priv), "public_key": str(pub), "key_id": kid})
        return
    console.print(f"key {kid}: private {priv} (keep it secret), public {pub}\n"
                  f"next: export EXAMLOPS_SIGNING_KEY={priv}; exa models trust add {pub}")


@trust_app.command("add")
def trust_add(pubfile: Annotated[Path, typer.Argument(help="A signing.pub written by `exa models keygen`.")],
              name: Annotated[str, typer.Option(help="A label for the key, e.g. release-ci.")] = "") -> None:
    """Trust a public key: versions it signs can be registered and promoted."""
    try:
        pem = pubfile.read_text()
        kid = key_id(load_public_pem(pem, str(pubfile)))
    except OSError as exc:
        fail(f"{pubfile}: cannot read ({exc.strerror})")
    except SigningError as exc:
        fail(str(exc))
    key = call("registry", "AddTrustedKey", reg.AddTrustedKeyRequest(
        key=reg.TrustedKey(key_id=kid, public_key_pem=pem, name=name or pubfile.stem), actor=Ctx.actor()))
    emit_json(message_dict(key)) if Ctx.json else console.print(f"trusted key {key.key_id} ({key.name})")


@trust_app.command("list")
def trust_list() -> None:
    """Trusted public keys."""
    keys = call("registry", "ListTrustedKeys", reg.ListTrustedKeysRequest()).keys
    if Ctx.json:
        emit_json([message_dict(k) | {"added_at_ms": k.added_at_ms} for k in keys])
        return
    table("Trusted signing keys", ["key id", "name", "added", "by"],
          [[k.key_id, k.name, _when(k.added_at_ms), k.added_by] for k in keys])


@trust_app.command("remove")
def trust_remove(key: Annotated[str, typer.Argument(help="Key id (exa models trust list).")]) -> None:
    """Stop trusting a key: versions it signed can no longer be promoted or verified."""
    removed = call("registry", "RemoveTrustedKey", reg.RemoveTrustedKeyRequest(key_id=key, actor=Ctx.actor()))
    emit_json(message_dict(removed)) if Ctx.json else console.print(f"removed trust in key {removed.key_id}")


@app.command()
def register(
    name: Annotated[str, typer.Argument(help="Model name, e.g. smol.")],
    path: Annotated[Path, typer.Option(help="The model folder (Hugging Face layout).")],
    version: Annotated[str, typer.Option(help="Version; default: one more than the highest numeric one.")] = "",
    dataset: Annotated[list[str] | None, typer.Option(help="Training dataset (repeatable); a local file is also "
                                                      "pinned by its SHA-256.")] = None,
    dataset_revision: Annotated[list[str] | None, typer.Option(help="Revision of each --dataset, in order.")] = None,
    parent: Annotated[str, typer.Option(help="NAME@V this version derives from.")] = "",
    project: Annotated[str, typer.Option(help="Project the version is attributed to.")] = "",
) -> None:
    """Hash every file, write a CycloneDX 1.6 ML-BOM, sign it (EXAMLOPS_SIGNING_KEY) and register NAME@V."""
    names, revisions = dataset or [], dataset_revision or []
    if len(names) != len(revisions):
        fail("give one --dataset-revision for each --dataset")
    if not path.is_dir():
        fail(f"{path}: no such directory")
    reg_ = Registration(name=name, version=version or next_version(name), folder=path,
                        datasets=[dataset_of(d, r, "training") for d, r in zip(names, revisions, strict=True)],
                        parent=get_version(parent) if parent else None, project=project)
    with hashing(path, "hashing") as progress:
        mv = register_version(reg_, Ctx.actor(), progress)
    emit_json(version_dict(mv)) if Ctx.json else console.print(
        f"registered {mv.name}@{mv.version}: {len(mv.files)} files, BOM sha256 {mv.bom_sha256[:16]}…, "
        f"signed by {mv.key_id}")


@app.command()
def versions(name: Annotated[str, typer.Argument(help="Model name; empty: every model.")] = "") -> None:
    """Registered versions with their quantization, eval gate and aliases."""
    found = call("registry", "ListModelVersions", reg.ListModelVersionsRequest(name=name)).versions
    if Ctx.json:
        emit_json([version_dict(v) for v in found])
        return
    rows = []
    for v in found:
        gate = ("PASS" if v.evals[-1].passed else "FAIL") if v.evals else "-"
        rows.append([f"{v.name}@{v.version}", v.parent or "-", v.quantization or "-",
                     "degraded" if v.degraded else "", gate, ",".join(v.aliases), _when(v.created_at_ms), v.key_id])
    table("Model versions", ["version", "parent", "quantization", "", "eval gate", "aliases", "registered", "key"],
          rows)


@app.command()
def bom(ref: Ref) -> None:
    """Print a version's CycloneDX ML-BOM (exactly the signed document)."""
    mv = get_version(ref)
    sys.stdout.write(orjson.dumps(orjson.loads(mv.bom_json), option=orjson.OPT_INDENT_2).decode() + "\n")


@app.command("verify")
def verify_cmd(
    ref: Ref,
    path: Annotated[Path | None, typer.Option(help="Folder to re-hash; default: the registered path.")] = None,
) -> None:
    """Check the signature against the trusted keys and re-hash every file: one changed byte fails, naming it."""
    mv = get_version(ref)
    folder = path or Path(mv.path)
    try:
        verify_here(mv, folder)
    except VerifyError as exc:
        if Ctx.json:
            emit_json({"ref": f"{mv.name}@{mv.version}", "verified": False, "reason": str(exc)})
            raise SystemExit(1) from None
        fail(str(exc))
    if Ctx.json:
        emit_json({"ref": f"{mv.name}@{mv.version}", "verified": True, "files": len(mv.files), "key_id": mv.key_id})
        return
    console.print(f"{mv.name}@{mv.version}: signature by trusted key {mv.key_id} verifies; "
                  f"{len(mv.files)} files in {folder} match the BOM")
