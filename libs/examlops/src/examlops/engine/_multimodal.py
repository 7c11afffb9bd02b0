"""The `multimodal:` part of an engine block: what media an endpoint accepts, and from where."""

from __future__ import annotations

import ipaddress
import re
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._errors import EngineBlockError, EngineBlockIssue

Modality = Literal["text", "vision", "audio", "video"]
MediaKind = Literal["image", "audio", "video"]

#: The media kind each modality serves (a vision endpoint takes images, and so on).
MODALITY_MEDIA: dict[str, frozenset[str]] = {
    "text": frozenset(),
    "vision": frozenset({"image"}),
    "audio": frozenset({"audio"}),
    "video": frozenset({"video", "image"}),
}

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
_DOMAIN_ACCEPTED = ("a bare host name such as example.com (no scheme, port, path or wildcard)",)


def _domain_problem(domain: str) -> str | None:
    """Why `domain` cannot be an entry of the media allow-list, or None when it can."""
    if not _HOSTNAME.match(domain):
        return "is not a host name"
    if domain == "localhost" or domain.endswith(".localhost"):
        return "names this machine: allowing it would let a prompt fetch from loopback"
    try:
        address = ipaddress.ip_address(domain)
    except ValueError:
        return None
    if address.is_loopback or address.is_link_local or address.is_unspecified:
        return "is a loopback/link-local address (e.g. cloud metadata): an SSRF target"
    return None


class MultimodalPolicy(BaseModel):
    """Media policy of one endpoint; enforced by mediaguard and rendered onto `vllm serve`.

    Rules checked here: a non-text modality must bound the media per prompt
    (`limit_mm_per_prompt`, an unbounded count is a denial-of-service surface) and may only
    bound the media kinds it serves; allow-list entries are bare host names (an empty list
    denies all remote media); `allowed_local_media_path` is an absolute directory other than /.
    Mediaguard refuses a remote media host that resolves to a loopback, private or link-local
    address unless `allow_private_addresses` is set (an endpoint fetching from an internal host).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    modality: Modality = "text"
    limit_mm_per_prompt: dict[MediaKind, int] = Field(default_factory=dict)
    allowed_media_domains: list[str] = Field(default_factory=list)
    allowed_local_media_path: str | None = None
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, gt=0)
    mm_processor_cache_gb: float | None = Field(default=None, ge=0)
    allow_private_addresses: bool = False

    @property
    def media_kinds(self) -> frozenset[str]:
        """Media kinds this endpoint serves (empty for a text-only endpoint)."""
        return MODALITY_MEDIA[self.modality]

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _counts_are_whole_numbers(cls, value: Any) -> Any:
        if isinstance(value, dict):
            issues = [
                EngineBlockIssue(str(kind), count, "a media count must be a whole number >= 0",
                                 ("an integer >= 0",))
                for kind, count in value.items()
                if isinstance(count, bool) or not isinstance(count, int) or count < 0
            ]
            if issues:
                raise EngineBlockError(issues)
        return value

    @field_validator("allowed_media_domains")
    @classmethod
    def _domains_are_host_names(cls, value: list[str]) -> list[str]:
        domains = [d.lower() for d in value]
        issues = [
            EngineBlockIssue(str(i), d, f"{d!r} {problem}", _DOMAIN_ACCEPTED)
            for i, d in enumerate(domains)
            if (problem := _domain_problem(d)) is not None
        ]
        if issues:
            raise EngineBlockError(issues)
        return domains

    @field_validator("allowed_local_media_path")
    @classmethod
    def _local_path_is_a_confined_root(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = PurePosixPath(value)
        accepted = ("an absolute directory other than /, without '..'",)
        if not path.is_absolute() or ".." in path.parts or path == PurePosixPath("/"):
            raise EngineBlockError.single(
                "", value, "file:// media must be confined to one absolute directory", accepted
            )
        return str(path)

    @model_validator(mode="after")
    def _limits_match_modality(self) -> MultimodalPolicy:
        served = self.media_kinds
        accepted = tuple(f"{{{kind}: <count>}}" for kind in sorted(served)) or ("{} (no media)",)
        issues: list[EngineBlockIssue] = [
            EngineBlockIssue(
                f"limit_mm_per_prompt.{kind}", count,
                f"a {self.modality} endpoint serves no {kind} media", accepted,
            )
            for kind, count in self.limit_mm_per_prompt.items()
            if kind not in served
        ]
        if served and not any(n > 0 for k, n in self.limit_mm_per_prompt.items() if k in served):
            issues.append(EngineBlockIssue(
                "limit_mm_per_prompt", dict(self.limit_mm_per_prompt),
                f"modality {self.modality!r} needs a per-prompt media limit: an unbounded media "
                "count per request is a denial-of-service surface", accepted,
            ))
        if issues:
            raise EngineBlockError(issues)
        return self
