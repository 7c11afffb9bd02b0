"""Echo embeddings: deterministic unit vectors in OpenAI's /v1/embeddings shape (dev and CI).

Each input (a string, or a list of token ids) gets its own vector, drawn from SHAKE-256 of the
input: the same input always embeds to the same vector, on any machine and Python version, and
two different inputs are nearly orthogonal (so a semantic cache never confuses them). Values are
float32, as vLLM answers: `encoding_format: base64` is the little-endian float32 bytes of exactly
the floats `float` returns. Usage counts words of a string and ids of a token list.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

from .._errors import EngineRejected

#: all-MiniLM-L6-v2's width, the embedded default's, so echo stands in for it shape for shape.
DEFAULT_DIMENSIONS = 384
MAX_DIMENSIONS = 8192
MAX_INPUTS = 2048
_DOMAIN = b"examlops-echo-embedding\0"


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                           for t in value)


def _inputs(raw: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, one token list, or a list of token lists."""
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and _is_tokens(raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise EngineRejected("input must be a non-empty string, list of strings, or token array(s)", "input")
    if len(items) > MAX_INPUTS:
        raise EngineRejected(f"input holds {len(items)} items; at most {MAX_INPUTS}", "input")
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and _is_tokens(item):
            continue
        raise EngineRejected(f"input[{i}] is not a non-empty string or a list of token ids", "input")
    return items


def _dimensions(raw: Any) -> int:
    if raw is None:
        return DEFAULT_DIMENSIONS
    if isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= MAX_DIMENSIONS:
        return raw
    raise EngineRejected(f"dimensions must be an integer from 1 to {MAX_DIMENSIONS}", "dimensions")


def echo_vector(item: str | list[int], dimensions: int) -> list[float]:
    """The unit-norm float32 vector of one input (seeded by its SHA-256, via SHAKE-256)."""
    key = item.encode() if isinstance(item, str) else b"tokens:" + ",".join(map(str, item)).encode()
    seed = hashlib.sha256(key).digest()
    words = struct.unpack(f"<{dimensions}I", hashlib.shake_256(_DOMAIN + seed).digest(4 * dimensions))
    raw = [w / 2**31 - 1.0 for w in words]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    # Round through float32 once, so float and base64 answers carry the same numbers.
    packed = struct.pack(f"<{dimensions}f", *(v / norm for v in raw))
    return list(struct.unpack(f"<{dimensions}f", packed))


def echo_embeddings(body: dict[str, Any], model: str) -> tuple[dict[str, Any], int]:
    """The /v1/embeddings answer to `body`, and its prompt tokens."""
    items = _inputs(body.get("input"))
    dimensions = _dimensions(body.get("dimensions"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise EngineRejected("encoding_format must be 'float' or 'base64'", "encoding_format")
    data: list[dict[str, Any]] = []
    tokens = 0
    for index, item in enumerate(items):
        vector = echo_vector(item, dimensions)
        tokens += len(item.split()) if isinstance(item, str) else len(item)
        embedding: list[float] | str = vector
        if encoding == "base64":
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}, tokens
