"""The `multimodal:` part of an engine block: what media an endpoint accepts, and from where."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class MultimodalPolicy(BaseModel):
    """Media policy of one endpoint; enforced by mediaguard and rendered onto `vllm serve`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    modality: Modality = "text"
    limit_mm_per_prompt: dict[MediaKind, int] = Field(default_factory=dict)
    allowed_media_domains: list[str] = Field(default_factory=list)
    allowed_local_media_path: str | None = None
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, gt=0)
    mm_processor_cache_gb: float | None = Field(default=None, ge=0)

    @property
    def media_kinds(self) -> frozenset[str]:
        """Media kinds this endpoint serves (empty for a text-only endpoint)."""
        return MODALITY_MEDIA[self.modality]
