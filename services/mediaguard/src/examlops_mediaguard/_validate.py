"""Pure validation of OpenAI chat ``messages`` against an endpoint's `MultimodalPolicy`.

`validate_messages` never fetches anything and never resolves a name. It either raises
`MediaRejected` (codes listed in ``_errors``) or returns new messages in which every media part
has been rebuilt from the fields it checked, with each URL replaced by its canonical form, so
the engine fetches exactly what was validated.

Rules, in the order they are applied to each content part:

* A part is a string (text) or an object with a string ``type``. Text types (``text``,
  ``input_text``, ``output_text``, ``refusal``, ``thinking``, ``tool_reference``) pass through
  unchanged unless they carry a media field or a ``uuid``: vLLM reads media from such fields
  when a part has a ``uuid`` or no ``type``, so those forms are refused, never guessed at.
* Media parts are ``image_url`` (object or bare-string form), ``input_image``, ``input_audio``,
  ``audio_url`` and ``video_url``. Embeddings, PIL images, files and unknown types are refused:
  embeddings are deserialised tensors that bypass every check made here.
* The part's kind must be served by the endpoint's modality, and the running count of that kind
  must stay within ``limit_mm_per_prompt``; a served kind with no limit entry has a limit of 0.
* URLs: http(s) per ``_url`` (allow-listed domains and their subdomains; an empty list denies
  all remote media), ``data:`` per ``_data`` (base64 only, typed, sized from its length, magic
  number checked), ``file:`` per ``_local`` (only with a local root, resolved inside it). Every
  other scheme is refused. ``max_image_bytes`` bounds every inline payload and local file,
  whatever its kind: it is the policy's only size limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from examlops.engine import MultimodalPolicy
from examlops.mediaparts import MEDIA_FIELDS, TEXT_PART_TYPES, has_media, is_text_type

from ._data import INPUT_AUDIO_FORMATS, check_base64_payload, check_data_url
from ._errors import (
    COUNT_EXCEEDED,
    MODALITY_NOT_SUPPORTED,
    PART_MALFORMED,
    REJECTION_CODES,
    SCHEME_NOT_ALLOWED,
    TYPE_NOT_ALLOWED,
    MediaRejected,
    PartRefused,
    shorten,
)
from ._local import check_file_url
from ._url import check_characters, check_remote_url, normalise_domains, split_scheme

__all__ = [
    "REJECTION_CODES",
    "MediaRejected",
    "ValidatedMessages",
    "has_media",
    "strip_media",
    "validate_messages",
]

#: URL-carrying part types: the media kind and the field that holds the URL.
_URL_PARTS: Final = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "audio_url": ("audio", "audio_url"),
    "video_url": ("video", "video_url"),
}
_EMBEDS: Final = "precomputed embeddings are deserialised tensors that bypass media checks"
_REFUSED_PARTS: Final = {
    "image_embeds": _EMBEDS,
    "audio_embeds": _EMBEDS,
    "video_embeds": _EMBEDS,
    "prompt_embeds": _EMBEDS,
    "image_pil": "PIL images only exist inside a Python process",
    "file": "file attachments are not accepted as media",
    "input_file": "file attachments are not accepted as media",
}
_DETAILS: Final = frozenset({"auto", "low", "high"})


@dataclass(frozen=True, slots=True)
class ValidatedMessages:
    """Messages safe to forward, and how many media parts of each kind they hold."""

    messages: list[dict[str, Any]]
    counts: dict[str, int]

    @property
    def media_parts(self) -> int:
        return sum(self.counts.values())


def validate_messages(messages: list[dict[str, Any]], policy: MultimodalPolicy) -> ValidatedMessages:
    """Check every content part against ``policy``; raise `MediaRejected` at the first violation."""
    if not isinstance(messages, list):
        raise MediaRejected(PART_MALFORMED, "messages must be a list", "messages", -1)
    checker = _PartChecker(policy)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MediaRejected(PART_MALFORMED, "a message must be an object", f"messages[{i}]", -1)
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append(dict(message))
            continue
        if not isinstance(content, list):
            raise MediaRejected(
                PART_MALFORMED,
                "content must be a string or a list of parts",
                f"messages[{i}].content",
                -1,
            )
        parts: list[Any] = []
        for j, part in enumerate(content):
            try:
                parts.append(checker.check(part))
            except PartRefused as refused:
                param = f"messages[{i}].content[{j}]"
                raise MediaRejected(refused.code, refused.message, param, j) from None
        out.append({**message, "content": parts})
    return ValidatedMessages(out, dict(checker.counts))


def strip_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Drop every media part (for text-only endpoints); return new messages and how many went.

    Text survives. A text part carrying media fields keeps its text and loses the fields, which
    counts as one dropped part. Messages that are not objects with a list content are passed on
    as they are, for the request schema to judge.
    """
    out: list[dict[str, Any]] = []
    dropped = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        kept: list[Any] = []
        for part in content:
            if isinstance(part, str):
                kept.append(part)
            elif isinstance(part, dict) and is_text_type(part.get("type")):
                if MEDIA_FIELDS.isdisjoint(part):
                    kept.append(dict(part))
                else:
                    kept.append({k: v for k, v in part.items() if k not in MEDIA_FIELDS})
                    dropped += 1
            else:
                dropped += 1
        out.append({**message, "content": kept})
    return out, dropped


class _PartChecker:
    """Checks parts one by one for one request, keeping the running count of each media kind."""

    def __init__(self, policy: MultimodalPolicy) -> None:
        self.kinds = policy.media_kinds
        self.limits: dict[str, int] = {str(k): v for k, v in policy.limit_mm_per_prompt.items()}
        self.domains = normalise_domains(policy.allowed_media_domains)
        self.root = policy.allowed_local_media_path
        self.max_bytes = policy.max_image_bytes
        self.counts: dict[str, int] = {}

    def check(self, part: Any) -> Any:
        """Return the part as it may be forwarded, or raise `PartRefused`."""
        if isinstance(part, str):
            return part
        if not isinstance(part, dict):
            raise PartRefused(PART_MALFORMED, "a content part must be a string or an object")
        part_type = part.get("type")
        if not isinstance(part_type, str):
            raise PartRefused(PART_MALFORMED, "a content part needs a string 'type'")
        if "uuid" in part:
            raise PartRefused(
                PART_MALFORMED,
                "'uuid' is refused: it keys the engine's media cache across tenants",
            )
        if part_type in TEXT_PART_TYPES:
            if not MEDIA_FIELDS.isdisjoint(part):
                smuggled = sorted(MEDIA_FIELDS.intersection(part))[0]
                raise PartRefused(PART_MALFORMED, f"a {part_type} part carries {smuggled!r}")
            return dict(part)
        if part_type in _REFUSED_PARTS:
            raise PartRefused(TYPE_NOT_ALLOWED, f"{part_type!r} parts are refused: " + _REFUSED_PARTS[part_type])
        if part_type == "input_audio":
            self._admit(part, "audio", "input_audio")
            return self._input_audio(part)
        if part_type not in _URL_PARTS:
            raise PartRefused(TYPE_NOT_ALLOWED, f"unknown content part type {shorten(part_type)}")
        kind, field = _URL_PARTS[part_type]
        self._admit(part, kind, field)
        url, detail = _url_and_detail(part, field)
        checked = self._url(url, kind)
        if kind != "image":
            return {"type": part_type, field: {"url": checked}}
        image: dict[str, str] = {"url": checked}
        if detail is not None:
            image["detail"] = detail
        return {"type": "image_url", "image_url": image}

    def _admit(self, part: dict[str, Any], kind: str, field: str) -> None:
        """Admit one more part of media `kind`, or refuse it (smuggled fields, modality, limit)."""
        others = MEDIA_FIELDS.intersection(part) - {field}
        if others:
            raise PartRefused(PART_MALFORMED, f"the {kind} part also carries {sorted(others)[0]!r}")
        if kind not in self.kinds:
            raise PartRefused(MODALITY_NOT_SUPPORTED, f"this endpoint does not accept {kind} input")
        count = self.counts.get(kind, 0) + 1
        limit = self.limits.get(kind, 0)
        if count > limit:
            raise PartRefused(COUNT_EXCEEDED, f"more than {limit} {kind} part(s) in one prompt")
        self.counts[kind] = count

    def _url(self, url: Any, kind: str) -> str:
        if not isinstance(url, str):
            raise PartRefused(PART_MALFORMED, "the media URL must be a string")
        scheme = split_scheme(url)
        if scheme == "data":
            return check_data_url(url, kind, self.max_bytes)
        check_characters(url)
        if scheme in ("http", "https"):
            return check_remote_url(url, scheme, self.domains)
        if scheme == "file":
            return check_file_url(url, kind, self.root, self.max_bytes)
        raise PartRefused(SCHEME_NOT_ALLOWED, f"URL scheme {scheme!r} is not accepted for media")

    def _input_audio(self, part: dict[str, Any]) -> dict[str, Any]:
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        fmt = audio.get("format") if isinstance(audio, dict) else None
        if not isinstance(data, str) or not isinstance(fmt, str):
            raise PartRefused(PART_MALFORMED, "input_audio needs string 'data' and 'format'")
        mime = INPUT_AUDIO_FORMATS.get(fmt.lower())
        if mime is None:
            accepted = ", ".join(sorted(INPUT_AUDIO_FORMATS))
            raise PartRefused(TYPE_NOT_ALLOWED, f"audio format {shorten(fmt)} is not {accepted}")
        check_base64_payload(data, mime, self.max_bytes)
        return {"type": "input_audio", "input_audio": {"data": data, "format": fmt.lower()}}


def _url_and_detail(part: dict[str, Any], field: str) -> tuple[Any, str | None]:
    """The URL of a media part (object or bare-string form) and its optional ``detail``."""
    value = part.get(field)
    if isinstance(value, str):
        url: Any = value
        detail = part.get("detail")  # input_image keeps detail beside the URL
    elif isinstance(value, dict):
        url = value.get("url")
        detail = value.get("detail")
    else:
        raise PartRefused(PART_MALFORMED, f"{field!r} must be a URL or an object with a 'url'")
    if detail is not None and (not isinstance(detail, str) or detail not in _DETAILS):
        raise PartRefused(PART_MALFORMED, "'detail' must be one of auto, low, high")
    return url, detail
