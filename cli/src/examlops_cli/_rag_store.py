"""Where `exa rag` keeps a collection, and how a re-index replaces it without a moment of loss.

A collection is a folder of three files: `chunks.jsonl` (one chunk a line, with its source),
`vectors.npy` (float32, one L2-normalized row per chunk, in the same order) and `meta.json` (the
embedding route and dimension, when it was built, the source files with their SHA-256). The name
`<root>/<collection>` is a symlink to the folder holding the current build; a re-index writes a new
folder beside it and swaps the link with one rename, so a crash at any point leaves either the old
collection or the new one, complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ._output import Ctx

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
FORMAT = 1
Vectors = npt.NDArray[np.float32]


class CollectionError(ValueError):
    """A collection that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Collection:
    name: str
    meta: dict[str, Any]
    chunks: list[dict[str, Any]]
    vectors: Vectors


def rag_root() -> Path:
    configured = Ctx.settings().rag_dir
    if configured:
        return Path(configured).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "examlops" / "rag"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise CollectionError(f"invalid collection name {name!r}: use letters, digits, '.', '_' or '-' "
                              "(at most 63, starting with a letter or digit)")
    return name


def normalized(rows: Vectors) -> Vectors:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: Vectors = (rows / np.where(norms == 0, 1, norms)).astype(np.float32)
    return out


def write_collection(name: str, meta: dict[str, Any], chunks: list[dict[str, Any]], vectors: Vectors) -> Path:
    """Write the build to a new folder, then point the collection's name at it in one rename."""
    root = rag_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".lock~{name}").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builds of one collection at once: one after the other
        build = root / f".build~{name}~{uuid.uuid4().hex[:12]}"
        build.mkdir()
        _write_build(build, root / name, meta, chunks, vectors)
        _remove_stale_builds(root, name, keep=build.name)
    return root / name


def _write_build(build: Path, link: Path, meta: dict[str, Any], chunks: list[dict[str, Any]],
                 vectors: Vectors) -> None:
    root = build.parent
    try:
        with (build / "chunks.jsonl").open("wb") as fh:
            for chunk in chunks:
                fh.write(orjson.dumps(chunk) + b"\n")
        with (build / "vectors.npy").open("wb") as fh:
            np.save(fh, vectors.astype(np.float32), allow_pickle=False)
        (build / "meta.json").write_bytes(orjson.dumps({"format": FORMAT, **meta}, option=orjson.OPT_INDENT_2))
        for written in build.iterdir():
            _fsync(written)
        _fsync(build)
        if link.exists() and not link.is_symlink():  # a plain folder from outside: move it aside first
            link.rename(root / f".build~{link.name}~{uuid.uuid4().hex[:12]}")
        temp_link = root / f".link~{link.name}~{uuid.uuid4().hex[:12]}"
        temp_link.symlink_to(build.name)
        temp_link.replace(link)
        _fsync(root)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_builds(root: Path, name: str, keep: str) -> None:
    """The builds the link no longer points at (the one replaced, leftovers of a crashed index)."""
    for entry in [*root.glob(f".build~{name}~*"), *root.glob(f".link~{name}~*")]:
        if entry.name == keep:
            continue
        if entry.is_symlink() or entry.is_file():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def read_meta(name: str) -> dict[str, Any]:
    folder = rag_root() / check_name(name)
    try:
        meta: dict[str, Any] = orjson.loads((folder / "meta.json").read_bytes())
    except FileNotFoundError:
        raise CollectionError(f"no collection named {name!r} in {rag_root()}: build it with "
                              f"`exa rag index PATH --collection {name}`") from None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CollectionError(f"collection {name!r} is unreadable ({exc}): rebuild it with "
                              f"`exa rag index PATH --collection {name}`") from None
    return meta


def load_collection(name: str) -> Collection:
    meta = read_meta(name)
    folder = rag_root() / name
    try:
        chunks = [orjson.loads(line) for line in (folder / "chunks.jsonl").read_bytes().splitlines() if line]
        vectors: Vectors = np.load(folder / "vectors.npy", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CollectionError(f"collection {name!r} is unreadable ({exc}): rebuild it with "
                              f"`exa rag index PATH --collection {name}`") from None
    if vectors.ndim != 2 or len(chunks) != vectors.shape[0]:
        raise CollectionError(f"collection {name!r} has {len(chunks)} chunks but {vectors.shape[0]} vectors: "
                              f"rebuild it with `exa rag index PATH --collection {name}`")
    return Collection(name, meta, chunks, vectors)


def list_collections() -> list[dict[str, Any]]:
    root = rag_root()
    if not root.is_dir():
        return []
    out: list[dict[str, Any]] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or not NAME_RE.match(entry.name):
            continue
        with contextlib.suppress(CollectionError):
            out.append({"collection": entry.name, **read_meta(entry.name)})
    return out


def top_k(vectors: Vectors, query: Vectors, k: int) -> list[tuple[int, float]]:
    """The `k` rows most similar to `query` by cosine (rows and query normalized), best first."""
    scores = vectors @ normalized(query.reshape(1, -1))[0]
    k = min(k, len(scores))
    best = np.argpartition(-scores, k - 1)[:k] if k else np.array([], dtype=np.int64)
    ranked = sorted(best.tolist(), key=lambda i: (-float(scores[i]), i))
    return [(i, float(scores[i])) for i in ranked]
