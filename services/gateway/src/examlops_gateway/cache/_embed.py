"""One text to one unit-norm vector through an embedding route, for the semantic cache.

The call is a client's `/v1/embeddings` request carried by engine-proxy (kind EMBEDDINGS), whose
answer is one final message holding the whole OpenAI embeddings object. Anything but a readable,
finite, non-zero vector raises `CacheEmbedError` naming the route: the caller then treats the
request as a cache miss and never serves from a vector it could not trust.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import grpc
import numpy as np
import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.svc import error_reason

__all__ = ["CacheEmbedError", "embed", "embeddings_request", "read_embedding"]


class CacheEmbedError(Exception):
    """The embedding route gave no usable vector (gRPC error, timeout, empty or unreadable answer)."""


def embeddings_request(route: str, text: str) -> bytes:
    """The OpenAI embeddings body for one input, asking for plain floats."""
    return orjson.dumps({"model": route, "input": [text], "encoding_format": "float"})


def read_embedding(route: str, data: bytes) -> np.ndarray:
    """The unit-norm float32 vector of an OpenAI embeddings answer's first input (data[0])."""
    try:
        answer: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise CacheEmbedError(f"the embedding route {route!r} answered with something that is not JSON") from None
    if not isinstance(answer, dict):
        raise CacheEmbedError(f"the embedding route {route!r} answered with a JSON {type(answer).__name__}, "
                              "not an embeddings object")
    if "error" in answer:
        error = answer["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise CacheEmbedError(f"the embedding route {route!r} answered with an error: {message}")
    items = answer.get("data")
    if not isinstance(items, list) or not items or not isinstance(items[0], dict):
        raise CacheEmbedError(f"the embedding route {route!r} answered without data[0]")
    first = min(items, key=lambda item: item.get("index", 0) if isinstance(item, dict) else 0)
    raw = first.get("embedding")
    try:
        if isinstance(raw, str):  # encoding_format base64: little-endian float32
            vector = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<f4").astype(np.float64)
        elif isinstance(raw, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in raw):
            vector = np.asarray(raw, dtype=np.float64)  # float32 only once normalized: no overflow
        else:
            raise CacheEmbedError(f"the embedding route {route!r} answered with data[0].embedding of type "
                                  f"{type(raw).__name__}, not a list of numbers or base64")
    except (binascii.Error, ValueError):
        raise CacheEmbedError(f"the embedding route {route!r} answered with an unreadable base64 embedding") from None
    if vector.ndim != 1 or vector.size == 0:
        raise CacheEmbedError(f"the embedding route {route!r} answered with an empty embedding")
    if not np.all(np.isfinite(vector)):
        raise CacheEmbedError(f"the embedding route {route!r} answered with a non-finite embedding")
    norm = float(np.linalg.norm(vector))
    if norm == 0.0 or not np.isfinite(norm):
        raise CacheEmbedError(f"the embedding route {route!r} answered with a zero embedding")
    return (vector / norm).astype(np.float32)


async def embed(engine_proxy: ep_grpc.EngineProxyStub, route: str, text: str, timeout_s: float) -> np.ndarray:
    """Embed `text` on `route` through engine-proxy within `timeout_s`; unit-norm float32."""
    request = pb.GenerateRequest(endpoint=route, kind=pb.REQUEST_KIND_EMBEDDINGS,
                                 body_json=embeddings_request(route, text))
    try:
        chunk = await engine_proxy.GenerateOnce(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        reason, _ = error_reason(exc)
        detail = f"{exc.code().name}{f' ({reason})' if reason else ''}: {exc.details()}"
        raise CacheEmbedError(f"the embedding route {route!r} failed: {detail}") from None
    if not chunk.data:
        raise CacheEmbedError(f"the embedding route {route!r} answered nothing")
    return read_embedding(route, bytes(chunk.data))
