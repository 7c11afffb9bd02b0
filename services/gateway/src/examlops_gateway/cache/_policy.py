"""Cache policies: per endpoint, and optionally per key, what the response cache does for a call.

A policy names its mode (`exact` or `semantic`), how long an answer is kept (`ttl_s`), who shares
answers (`scope`: the key alone, its project, or its tenant), whether sampled requests are cached
(`sampled`) and, for semantic mode, the embedding route and the similarity threshold. Validation
errors name the field, as the admin API returns them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..governance import MODEL_RE

MODES = ("exact", "semantic")
SCOPES = ("key", "project", "tenant")
DEFAULT_EMBEDDING_ROUTE = "minilm"
DEFAULT_THRESHOLD = 0.95
DEFAULT_TTL_S = 600
MAX_TTL_S = 7 * 86_400
_FIELDS = {"mode", "embedding_model", "threshold", "ttl_s", "scope", "sampled"}


class CachePolicyError(ValueError):
    """A policy is wrong; `field` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class CachePolicy:
    model: str                       # the endpoint (route) it applies to
    mode: str
    key_id: str = ""                 # '': every key of the endpoint; else only this key (it wins)
    embedding_model: str = DEFAULT_EMBEDDING_ROUTE
    threshold: float = DEFAULT_THRESHOLD
    ttl_s: int = DEFAULT_TTL_S
    scope: str = "key"
    sampled: bool = False

    @property
    def slot(self) -> str:
        """Its field in Redis: `model`, or `model|key_id` for a key's own policy."""
        return policy_slot(self.model, self.key_id)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.mode != "semantic":
            out.pop("embedding_model")
            out.pop("threshold")
        return out


def policy_slot(model: str, key_id: str = "") -> str:
    return f"{model}|{key_id}" if key_id else model


def _number(obj: dict[str, Any], name: str, default: float) -> float:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CachePolicyError(name, f"a number, not {value!r}")
    return float(value)


def parse_policy(model: str, obj: Any, key_id: str = "") -> CachePolicy:
    """A policy from its JSON (the admin API's body, or Redis); raises CachePolicyError."""
    if not MODEL_RE.match(model):
        raise CachePolicyError("model", f"invalid model name {model!r}")
    if not isinstance(obj, dict):
        raise CachePolicyError("body", "a JSON object with `mode` and the policy's settings")
    unknown = sorted(set(obj) - _FIELDS - {"model", "key_id"})
    if unknown:
        raise CachePolicyError(unknown[0], f"unknown field (accepted: {', '.join(sorted(_FIELDS))})")
    mode = obj.get("mode")
    if mode not in MODES:
        raise CachePolicyError("mode", f"{mode!r} is not a cache mode (accepted: {', '.join(MODES)}; "
                                       "remove a policy with `exa gateway cache unset`)")
    scope = obj.get("scope", "key")
    if scope not in SCOPES:
        raise CachePolicyError("scope", f"{scope!r} is not a scope (accepted: {', '.join(SCOPES)})")
    threshold = _number(obj, "threshold", DEFAULT_THRESHOLD)
    if not 0 < threshold <= 1:
        raise CachePolicyError("threshold", f"{threshold:g} is not a cosine similarity in (0, 1]")
    ttl = _number(obj, "ttl_s", DEFAULT_TTL_S)
    if ttl != int(ttl) or not 1 <= ttl <= MAX_TTL_S:
        raise CachePolicyError("ttl_s", f"{ttl:g} is not a whole number of seconds from 1 to {MAX_TTL_S}")
    route = obj.get("embedding_model", DEFAULT_EMBEDDING_ROUTE)
    if not isinstance(route, str) or not MODEL_RE.match(route):
        raise CachePolicyError("embedding_model", f"invalid route name {route!r}")
    sampled = obj.get("sampled", False)
    if not isinstance(sampled, bool):
        raise CachePolicyError("sampled", f"true or false, not {sampled!r}")
    return CachePolicy(model=model, mode=mode, key_id=key_id, embedding_model=route, threshold=threshold,
                       ttl_s=int(ttl), scope=scope, sampled=sampled)
