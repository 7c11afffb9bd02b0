"""The response cache: exact and semantic, shared by every gateway replica through Redis, under
per-endpoint and per-key policies. See services/gateway/CACHE.md.
"""

from ._embed import CacheEmbedError, embed
from ._policy import MODES, SCOPES, CachePolicy, CachePolicyError, parse_policy
from ._replay import sse_events
from ._request import space_prefix
from ._semantic import SemanticIndex
from ._stage import HEADER, CacheCall, CacheStage, StreamTap
from ._store import CacheBook, CacheStore

__all__ = [
    "HEADER", "MODES", "SCOPES", "CacheBook", "CacheCall", "CacheEmbedError", "CachePolicy", "CachePolicyError",
    "CacheStage", "CacheStore", "SemanticIndex", "StreamTap", "embed", "parse_policy", "space_prefix", "sse_events",
]
