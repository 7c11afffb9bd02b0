"""Building chat messages from the command line (local images become data: URLs)."""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path
from typing import Any

MAX_INLINE_BYTES = 32 * 1024 * 1024


def image_part(ref: str) -> dict[str, Any]:
    """A URL stays a URL; a local file is inlined, because the server usually runs elsewhere."""
    if "://" in ref or ref.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": ref}}
    path = Path(ref).expanduser()
    if not path.is_file():
        raise ValueError(f"--image {ref}: no such file (give a local file or an http(s) URL)")
    size = path.stat().st_size
    if size > MAX_INLINE_BYTES:
        raise ValueError(f"--image {ref}: {size} bytes is more than the {MAX_INLINE_BYTES} bytes inlined")
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def build_messages(text: str, images: list[str]) -> list[dict[str, Any]]:
    if not images:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *[image_part(i) for i in images]]}]
