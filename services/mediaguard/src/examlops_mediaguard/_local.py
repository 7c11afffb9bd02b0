"""``file://`` media: accepted only for existing regular files strictly inside the local root.

The path is resolved with symlinks followed (``os.path.realpath(strict=True)``), so a link that
points out of the root is judged by where it lands, and the URL forwarded names the resolved file,
not the link. The file must exist here: mediaguard can vouch only for a path it can see, so the
root must be mounted (read-only is enough) at the same path in mediaguard as in the engine. A
missing mount then shows up as refusals, never as unchecked paths.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Final
from urllib.parse import quote

from ._data import MEDIA_TYPES, SIGNATURES
from ._errors import (
    PATH_NOT_ALLOWED,
    SCHEME_NOT_ALLOWED,
    TOO_LARGE,
    TYPE_NOT_ALLOWED,
    URL_MALFORMED,
    PartRefused,
    shorten,
)

_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
# Escapes that would change how the path splits into segments, or smuggle a NUL or control char.
_FORBIDDEN_ESCAPES: Final = frozenset(b"./\\") | frozenset(range(0x20)) | {0x7F}
_SNIFF_BYTES: Final = 12
# One message for "missing" and "outside the root", so refusals do not reveal which files exist.
_NOT_IN_ROOT: Final = "not an existing file inside the media root: "


def check_file_url(url: str, kind: str, root: str | None, max_bytes: int) -> str:
    """Validate a ``file:`` URL (characters already checked); return the canonical resolved URL."""
    if root is None:
        raise PartRefused(SCHEME_NOT_ALLOWED, "file:// media is disabled on this endpoint")
    rest = url[5:]
    if not rest.startswith("///"):
        raise PartRefused(URL_MALFORMED, f"file URLs must be file:///absolute/path: {shorten(url)}")
    raw_path = rest[2:]
    if "?" in raw_path or "#" in raw_path:
        raise PartRefused(URL_MALFORMED, f"query or fragment in a file URL: {shorten(url)}")
    path = _unescape(raw_path)
    try:
        real_root = os.path.realpath(root, strict=True)
    except (OSError, ValueError):
        raise PartRefused(PATH_NOT_ALLOWED, "the media root is not mounted here") from None
    try:
        resolved = os.path.realpath(path, strict=True)
        info = os.stat(resolved)
    except (OSError, ValueError):
        raise PartRefused(PATH_NOT_ALLOWED, _NOT_IN_ROOT + shorten(raw_path)) from None
    inside = real_root if real_root.endswith(os.sep) else real_root + os.sep
    if not resolved.startswith(inside):
        raise PartRefused(PATH_NOT_ALLOWED, _NOT_IN_ROOT + shorten(raw_path))
    if not stat.S_ISREG(info.st_mode):
        raise PartRefused(PATH_NOT_ALLOWED, f"not a regular file: {shorten(path)}")
    if info.st_size > max_bytes:
        raise PartRefused(TOO_LARGE, f"file has {info.st_size} bytes, limit {max_bytes}")
    _check_magic(resolved, kind)
    return "file://" + quote(resolved, safe="/")


def _unescape(raw_path: str) -> str:
    """Percent-decode ``raw_path`` as the engine will, refusing escapes that hide traversal."""
    if "%" not in raw_path:
        return raw_path
    pieces = _ESCAPE.split(raw_path)
    if any("%" in piece for piece in pieces[::2]):
        raise PartRefused(URL_MALFORMED, f"bad percent-escape in path: {shorten(raw_path)}")
    decoded = bytearray()
    for index, piece in enumerate(pieces):
        if index % 2 == 0:
            decoded += piece.encode("ascii")
            continue
        byte = int(piece, 16)
        if byte in _FORBIDDEN_ESCAPES:
            raise PartRefused(PATH_NOT_ALLOWED, f"percent-encoded {chr(byte)!r} in path: {shorten(raw_path)}")
        decoded.append(byte)
    try:
        return decoded.decode("utf-8")
    except UnicodeDecodeError:
        raise PartRefused(URL_MALFORMED, "path escapes are not UTF-8") from None


def _check_magic(path: str, kind: str) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(_SNIFF_BYTES)
    except OSError:
        raise PartRefused(PATH_NOT_ALLOWED, f"media file is not readable: {shorten(path)}") from None
    if not any(SIGNATURES[mime](head) for mime in MEDIA_TYPES[kind]):
        raise PartRefused(TYPE_NOT_ALLOWED, f"file is not an accepted {kind} format")
