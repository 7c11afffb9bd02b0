"""Use-case packs from the CLI's side: find a model's engine block, report its errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from examlops.engine import USECASE_DIR_ENV, EngineBlockError, ModelNotFoundError, find_model, parse_engine_block

from ._output import fail


def usecase_dir() -> Path | None:
    """$EXAMLOPS_USECASE_DIR, else ./usecases when it exists (a checkout after `make up`)."""
    if os.environ.get(USECASE_DIR_ENV):
        return Path(os.environ[USECASE_DIR_ENV])
    local = Path.cwd() / "usecases"
    return local if local.is_dir() else None


def pack_block(model: str) -> dict[str, Any] | None:
    """The model's engine block as JSON-ready data, or None when no pack has the model."""
    root = usecase_dir()
    if root is None:
        return None
    try:
        spec = find_model(model, root)
    except ModelNotFoundError:
        return None
    except EngineBlockError as exc:
        fail(f"invalid engine block for {model!r}:\n{exc}")
    block: dict[str, Any] = spec.engine.model_dump(mode="json", exclude_none=True)
    return block


def check_block(block: dict[str, Any]) -> None:
    try:
        parse_engine_block(block)
    except EngineBlockError as exc:
        fail(f"invalid engine block:\n{exc}")


def media_policy(current: dict[str, Any], modality: str, max_images: int, domains: list[str]) -> dict[str, Any]:
    """The block's multimodal policy with the command line's --modality/--max-images/--media-domains."""
    policy = dict(current)
    if modality:
        policy["modality"] = modality
    if max_images:
        limits = dict(policy.get("limit_mm_per_prompt") or {})
        limits["image"] = max_images
        policy["limit_mm_per_prompt"] = limits
    if domains:
        policy["allowed_media_domains"] = [d for item in domains for d in item.split(",") if d]
    return policy
