"""Model versions on the client side: hash, build the BOM, sign, register; and verify before use.

The registry checks a registration (signature against its trusted keys, BOM against the request);
`verify` repeats those checks here and re-hashes the files, which only a host that has them can do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from examlops.provenance import (
    BomError,
    Dataset,
    FileDigest,
    SigningError,
    Tool,
    VersionSpec,
    build_bom,
    compare,
    digest_folder,
    dump_bom,
    key_id,
    load_public_pem,
    load_signing_key,
    model_facts,
    read_claims,
    sha256_file,
    sign,
    validate_bom,
    verify,
)
from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, err_console, fail
from ._rpc import call

REF_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,62})@(?P<version>[A-Za-z0-9][A-Za-z0-9._-]{0,62})$")


@contextlib.contextmanager
def hashing(folder: Path, what: str) -> Iterator[Callable[[str, int], None] | None]:
    """A byte progress bar over a folder's files on stderr (none in --json mode or off a terminal)."""
    if Ctx.json or not sys.stderr.isatty() or not folder.is_dir():
        yield None
        return
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    with Progress(TextColumn(f"{what} [bold]{{task.description}}"), BarColumn(), DownloadColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda name, size: bar.update(task, advance=size, description=name)


class VerifyError(ValueError):
    """A version that must not be used; the message names the reason (and the file)."""


def parse_ref(ref: str) -> tuple[str, str]:
    m = REF_RE.match(ref)
    if not m:
        fail(f"{ref!r} is not NAME@VERSION (for example smol@1, smol@1-w8a8 or smol@Production)")
    return m["name"], m["version"]


def get_version(ref: str) -> reg.ModelVersion:
    name, version = parse_ref(ref)
    mv: reg.ModelVersion = call("registry", "GetModelVersion", reg.GetModelVersionRequest(name=name, version=version))
    return mv


def next_version(name: str) -> str:
    """One more than the highest numeric version of `name` (1 for a new model)."""
    resp = call("registry", "ListModelVersions", reg.ListModelVersionsRequest(name=name))
    numbers = [int(v.version) for v in resp.versions if v.version.isdigit()]
    return str(max(numbers, default=0) + 1)


def dataset_of(name: str, revision: str, role: str) -> Dataset:
    """A dataset named on the command line; a local file is also pinned by its digest."""
    if not revision:
        fail(f"--dataset {name} needs --dataset-revision: a dataset without a revision cannot be reproduced")
    path = Path(name)
    return Dataset(name=name, revision=revision, role=role, sha256=sha256_file(path) if path.is_file() else "")


def tools(extra: dict[str, str] | None = None) -> list[Tool]:
    found = [Tool("examlops", _version("examlops-cli"))]
    found += [Tool(n, v) for n, v in sorted((extra or {}).items())]
    return found


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class Registration:
    name: str
    version: str
    folder: Path
    datasets: list[Dataset]
    parent: reg.ModelVersion | None = None
    quantization: dict[str, Any] | None = None
    degraded_reason: str = ""
    tool_versions: dict[str, str] | None = None
    project: str = ""


def register(r: Registration, actor: str, progress: Callable[[str, int], None] | None = None) -> reg.ModelVersion:
    """Hash the folder, build and sign the BOM, register NAME@V; fail() with the reason on refusal."""
    try:
        key = load_signing_key()
    except SigningError as exc:
        fail(str(exc))
    try:
        files = digest_folder(r.folder, progress) if r.folder.is_dir() or not r.degraded_reason else []
    except FileNotFoundError as exc:
        fail(str(exc))
    spec = VersionSpec(
        name=r.name, version=r.version, files=files, facts=model_facts(r.folder), datasets=r.datasets,
        parent=f"{r.parent.name}@{r.parent.version}" if r.parent else "",
        parent_bom_sha256=r.parent.bom_sha256 if r.parent else "", quantization=r.quantization or {},
        degraded_reason=r.degraded_reason, tools=tools(r.tool_versions), project=r.project)
    text = dump_bom(build_bom(spec))
    validate_bom(text)
    mv = reg.ModelVersion(
        name=r.name, version=r.version, path=str(r.folder.resolve()), bom_json=text, signature=sign(key, text),
        key_id=key_id(key.public_key()), parent=spec.parent, quantization=(r.quantization or {}).get("method", ""),
        degraded=bool(r.degraded_reason), degraded_reason=r.degraded_reason, project=r.project,
        files=[reg.FileDigest(path=d.path, sha256=d.sha256, size=d.size) for d in files])
    out: reg.ModelVersion = call("registry", "RegisterModelVersion",
                                 reg.RegisterModelVersionRequest(version=mv, actor=actor))
    return out


def trusted_keys() -> dict[str, str]:
    resp = call("registry", "ListTrustedKeys", reg.ListTrustedKeysRequest())
    return {k.key_id: k.public_key_pem for k in resp.keys}


def check_record(mv: reg.ModelVersion, keys: dict[str, str]) -> None:
    """The registered BOM is valid, signed by a currently trusted key, and describes this record."""
    ref = f"{mv.name}@{mv.version}"
    if not mv.signature:
        raise VerifyError(f"{ref}: unsigned")
    if mv.key_id not in keys:
        raise VerifyError(f"{ref}: signed by key {mv.key_id}, which is not trusted (exa models trust list)")
    if not verify(load_public_pem(keys[mv.key_id], f"trusted key {mv.key_id}"), mv.bom_json, mv.signature):
        raise VerifyError(f"{ref}: the signature does not verify: the BOM or its signature was changed")
    if hashlib.sha256(mv.bom_json.encode()).hexdigest() != mv.bom_sha256:
        raise VerifyError(f"{ref}: the BOM's SHA-256 differs from the one recorded at registration")
    try:
        validate_bom(mv.bom_json)
        claims = read_claims(mv.bom_json)
    except BomError as exc:
        raise VerifyError(f"{ref}: {exc}") from None
    if (claims.name, claims.version) != (mv.name, mv.version):
        raise VerifyError(f"{ref}: the BOM describes {claims.name}@{claims.version}, not {ref}")


def check_files(mv: reg.ModelVersion, folder: Path, progress: Callable[[str, int], None] | None = None) -> None:
    """Re-hash `folder`: every file the BOM lists, unchanged, and nothing else."""
    claims = read_claims(mv.bom_json)
    try:
        actual = digest_folder(folder, progress)
    except FileNotFoundError as exc:
        raise VerifyError(f"{mv.name}@{mv.version}: {exc}") from None
    try:
        compare(claims.files, actual)
    except ValueError as exc:
        raise VerifyError(f"{mv.name}@{mv.version}: {exc}") from None


def verify_here(mv: reg.ModelVersion, folder: Path | None = None) -> None:
    """check_record against the keys trusted now, then re-hash `folder` (default: the registered path)."""
    check_record(mv, trusted_keys())
    where = folder or Path(mv.path)
    with hashing(where, "verifying") as progress:
        check_files(mv, where, progress)


def file_digests(mv: reg.ModelVersion) -> list[FileDigest]:
    return [FileDigest(f.path, f.sha256, f.size) for f in mv.files]


def servable_version(ref: str, rehash: bool = True) -> reg.ModelVersion:
    """The version `ref` names (an alias resolved), verified for serving: trusted signature, files
    unchanged (when this host has them), not degraded, and a quantization this host can serve."""
    mv = get_version(ref)
    label = f"{mv.name}@{mv.version}"
    if mv.degraded:
        fail(f"{label} is degraded ({mv.degraded_reason}): its transformation was recorded, not run, "
             "so there are no weights to serve")
    try:
        if rehash:
            verify_here(mv)
        else:
            check_record(mv, trusted_keys())
    except VerifyError as exc:
        fail(f"refusing to serve {label}: {exc}")
    return mv


def apply_version(block: dict[str, Any], mv: reg.ModelVersion) -> tuple[dict[str, Any], list[str]]:
    """The engine block serving `mv`: its folder as the model, and no `--quantization` that contradicts
    the checkpoint. A quantized version is a compressed-tensors checkpoint, whose scheme vLLM reads from
    its config.json; a plain version keeps only an on-the-fly method (fp8*) of the block."""
    from examlops.engine import QUANTIZATION_FOR_DTYPE

    out, notes = dict(block), []
    out["hf_model_id"] = mv.path
    current = out.get("quantization")
    if mv.quantization:
        wanted = "compressed-tensors" if str(out.get("dtype")) in QUANTIZATION_FOR_DTYPE else None
    else:
        wanted = current if current is None or str(current).startswith("fp8") else None
    if current != wanted:
        kind = f"a {mv.quantization} compressed-tensors checkpoint" if mv.quantization else "not a quantized checkpoint"
        notes.append(f"the block's quantization {current!r} is dropped: {mv.name}@{mv.version} is {kind}")
    out.pop("quantization", None)
    if wanted is not None:
        out["quantization"] = wanted
    return out, notes
