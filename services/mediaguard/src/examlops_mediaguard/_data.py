"""Inline media: ``data:`` URLs and ``input_audio`` payloads, checked without decoding them whole.

A base64 payload's decoded size follows from its length (three bytes per four characters, minus
padding), so a 2 GB payload is refused in constant time. Only a short prefix and suffix are
decoded: the prefix to compare the format's magic number with the declared type (a PNG declared
as JPEG, an HTML page declared as PNG), the suffix to check the padding. Characters in between are
not scanned: the size bound holds whatever they are, and the engine's decoder is the final word on
them.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable
from typing import Final

from ._errors import ENCODING_MISMATCH, TOO_LARGE, TYPE_NOT_ALLOWED, URL_MALFORMED, PartRefused
from ._errors import shorten as _shorten

Sniffer = Callable[[bytes], bool]

#: Magic-number tests, by canonical media type. 12 bytes is enough for all of them.
SIGNATURES: Final[dict[str, Sniffer]] = {
    "image/png": lambda b: b.startswith(b"\x89PNG\r\n\x1a\n"),
    "image/jpeg": lambda b: b.startswith(b"\xff\xd8\xff"),
    "image/gif": lambda b: b.startswith((b"GIF87a", b"GIF89a")),
    "image/webp": lambda b: b.startswith(b"RIFF") and b[8:12] == b"WEBP",
    "audio/wav": lambda b: b.startswith(b"RIFF") and b[8:12] == b"WAVE",
    "audio/mpeg": lambda b: b.startswith(b"ID3") or (len(b) > 1 and b[0] == 0xFF and b[1] >= 0xE0),
    "audio/flac": lambda b: b.startswith(b"fLaC"),
    "audio/ogg": lambda b: b.startswith(b"OggS"),
    "video/mp4": lambda b: b[4:8] == b"ftyp",
    "video/webm": lambda b: b.startswith(b"\x1a\x45\xdf\xa3"),
}

#: Media types each kind accepts. SVG is absent on purpose: it is a document that can carry script.
MEDIA_TYPES: Final[dict[str, frozenset[str]]] = {
    "image": frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"}),
    "audio": frozenset({"audio/wav", "audio/mpeg", "audio/flac", "audio/ogg"}),
    "video": frozenset({"video/mp4", "video/webm"}),
}

#: Common non-canonical spellings, rewritten to the canonical type in the forwarded URL.
_ALIASES: Final = {
    "image/jpg": "image/jpeg",
    "audio/x-wav": "audio/wav",
    "audio/wave": "audio/wav",
    "audio/mp3": "audio/mpeg",
}

#: ``input_audio.format`` values (the OpenAI schema's) and the media type each one declares.
INPUT_AUDIO_FORMATS: Final = {"wav": "audio/wav", "mp3": "audio/mpeg"}

_MAX_HEADER_CHARS: Final = 128
_SNIFF_CHARS: Final = 16  # base64 characters decoded for the magic check: 12 bytes


def check_data_url(url: str, kind: str, max_bytes: int) -> str:
    """Validate a ``data:`` URL for a part of media ``kind``; return its canonical form."""
    comma = url.find(",", 0, _MAX_HEADER_CHARS)
    if comma == -1:
        raise PartRefused(URL_MALFORMED, "data: URL has no ',' after a short media-type header")
    header = url[5:comma]
    if not header.isascii() or not header.isprintable() or " " in header:
        raise PartRefused(URL_MALFORMED, f"bad character in data: URL header: {_shorten(header)}")
    mime, semicolon, encoding = header.lower().rpartition(";")
    if not semicolon or encoding != "base64":
        raise PartRefused(ENCODING_MISMATCH, "data: URLs must be base64 (';base64,')")
    mime = _ALIASES.get(mime, mime)
    if mime not in MEDIA_TYPES[kind]:
        allowed = ", ".join(sorted(MEDIA_TYPES[kind]))
        raise PartRefused(TYPE_NOT_ALLOWED, f"{_shorten(mime)} is not an accepted {kind} type ({allowed})")
    check_base64_payload(url, mime, max_bytes, start=comma + 1)
    prefix = f"data:{mime};base64,"
    return url if url.startswith(prefix) else prefix + url[comma + 1 :]


def check_base64_payload(text: str, mime: str, max_bytes: int, start: int = 0) -> None:
    """Refuse the base64 payload ``text[start:]`` if too large, not base64, or not ``mime``.

    The payload is addressed by offset rather than sliced out: a copy of a 20 MB string would
    cost more than every check made here.
    """
    length = len(text) - start
    if length // 4 * 3 > max_bytes + 2:
        raise PartRefused(TOO_LARGE, f"payload decodes to more than {max_bytes} bytes")
    if not length:
        raise PartRefused(ENCODING_MISMATCH, "empty media payload")
    # CPython's strict decoder still accepts surplus padding ("AAAA===="), so count it here.
    if length % 4 or not text.isascii() or text.endswith("==="):
        raise PartRefused(ENCODING_MISMATCH, "payload is not canonical base64")
    padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    size = length // 4 * 3 - padding
    if size > max_bytes:
        raise PartRefused(TOO_LARGE, f"payload decodes to {size} bytes, limit {max_bytes}")
    try:
        head = binascii.a2b_base64(text[start : start + _SNIFF_CHARS], strict_mode=True)
        if length > _SNIFF_CHARS:
            binascii.a2b_base64(text[-_SNIFF_CHARS:], strict_mode=True)
    except binascii.Error:
        raise PartRefused(ENCODING_MISMATCH, "payload is not canonical base64") from None
    if not SIGNATURES[mime](head):
        actual = sniff(head)
        found = f"the bytes are {actual}" if actual else "the bytes match no accepted format"
        raise PartRefused(ENCODING_MISMATCH, f"declared {mime} but {found}")


def sniff(head: bytes) -> str | None:
    """The accepted media type whose magic number ``head`` starts with, if any."""
    return next((mime for mime, test in SIGNATURES.items() if test(head)), None)
