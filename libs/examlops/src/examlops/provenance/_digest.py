"""SHA-256 digests of a model folder's files: what a BOM carries and `verify` re-computes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Bookkeeping files of our own tools, never part of a model's content.
SKIPPED = frozenset({".complete"})
CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    path: str      # relative, '/'-separated
    sha256: str    # lowercase hex
    size: int


class DigestMismatch(ValueError):
    """The files on disk differ from the ones a BOM lists; `path` names the first difference."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def model_files(folder: Path) -> list[Path]:
    """Every regular file under `folder` (symlinks followed, hidden bookkeeping skipped), sorted."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory")
    files = [p for p in folder.rglob("*") if p.is_file() and p.name not in SKIPPED
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    if not files:
        raise FileNotFoundError(f"{folder}: no files to register")
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def digest_folder(folder: Path, progress: Callable[[str, int], None] | None = None) -> list[FileDigest]:
    """Digests of every file of a model folder; `progress(name, size)` is called after each file."""
    out = []
    for p in model_files(folder):
        rel = p.relative_to(folder).as_posix()
        out.append(FileDigest(rel, sha256_file(p), p.stat().st_size))
        if progress is not None:
            progress(rel, out[-1].size)
    return out


def compare(expected: list[FileDigest], actual: list[FileDigest], where: str = "the folder") -> None:
    """Raise DigestMismatch naming the first file that is listed twice, missing, extra or changed."""
    have: dict[str, FileDigest] = {}
    for d in actual:
        if d.path in have:
            raise DigestMismatch(d.path, f"{d.path}: listed twice in {where}")
        have[d.path] = d
    want = {d.path: d for d in expected}
    for path in sorted(want.keys() | have.keys()):
        w, h = want.get(path), have.get(path)
        if h is None:
            raise DigestMismatch(path, f"{path}: listed in the BOM but missing from {where}")
        if w is None:
            raise DigestMismatch(path, f"{path}: in {where} but not listed in the BOM")
        if (w.sha256, w.size) != (h.sha256, h.size):
            raise DigestMismatch(path, f"{path}: SHA-256 {h.sha256[:16]}… ({h.size} bytes) differs from the BOM's "
                                       f"{w.sha256[:16]}… ({w.size} bytes): the file was changed")
