"""Routing policies: which replica of a pool takes a request. Pure code, no I/O, no awaits.

The runtime (replica state, /metrics scraping, health, failover) hands `Router.pick` the replicas a
request may still use, with the load it knows of them; a pick costs a few microseconds and
allocates nothing bigger than a dict of the candidates.

Policies (the engine block's `routing:`):

- ``least-load``: the lowest ``running + waiting + in_flight``, plus a term for KV-cache pressure
  that grows without bound as ``kv_cache_usage`` nears 1 (a replica about to preempt is worse than
  its queue says). Metrics older than `STALE_AFTER_S` (or never scraped) count as saturated, llm-d's
  rule: such a replica is picked only when every candidate is stale, and then ``in_flight`` decides.
  Ties rotate, so equal replicas share the load.
- ``prefix``: bounded-load consistent hashing (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing
  with Bounded Loads", 2018) on a hash of the start of the rendered prompt, so requests that share a
  system prompt and first turns reach the same vLLM and hit its prefix cache, until that replica
  holds more than ``c = 1.25`` times the average load; then the walk moves on clockwise.
- ``session``: the same walk on the session (``x-session-id``, else the OpenAI ``user`` field).
- ``round-robin``: rotation, for comparison.

Why the prefix key is the first `PREFIX_CHARS` (1,024) characters of the canonical prompt text
(``role NUL text RS`` per chat message in order; a completion's prompt as is):

- requests that share a long system prompt must get the same key whatever follows it. A token is
  about four characters of English, and rarely under one in any script, so a system prompt of
  ~1,000 tokens covers the whole window in every language and the user's turn never reaches it;
- requests that share only a short system prompt ("You are a helpful assistant.", a few hundred
  tokens at most) must spread: their window reaches into the first user turn, which differs, and
  bounded-load hashing of distinct keys balances like random placement. What a shared prefix shorter
  than ~250 tokens would save in prefill is small next to the cost of piling requests on one replica;
- it is a prefix of what vLLM caches (the rendered chat template starts with the same texts in the
  same order), and vLLM's cache is block-granular (16 tokens), so a ~256-token shared start is many
  reusable blocks;
- it bounds the cost: at most ~1 KB is hashed (blake2b, 8-byte digest), whatever the request size,
  and the parsed body is read as is, never serialised again. Images and other non-text parts add a
  marker of their type only (their bytes may be megabytes, and the text decides the cache's
  reuse up to them).
"""

from __future__ import annotations

import math
from bisect import bisect
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any, Protocol, TypeVar

from examlops.engine import ROUTINGS
from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

STALE_AFTER_S = 2.0
"""Metrics older than this (seconds): the replica counts as saturated (llm-d's rule)."""
PREFIX_CHARS = 1_024
"""How much of the canonical prompt text the prefix key hashes (reasoning in the module docstring)."""
LOAD_FACTOR = 1.25
"""Bounded-load ``c``: no replica takes a keyed request past ``ceil(c * (total + 1) / n)``."""
VNODES = 160
"""Points per replica on the hash ring (Ketama's count): ~8 % spread of key shares between replicas."""
SATURATED = 1e12
"""The least-load score of a replica whose metrics are stale: above any real one, ordered by in_flight."""
KV_CLIP = 0.99

_CHAT = pb.REQUEST_KIND_CHAT
_KEYED = frozenset({"prefix", "session"})


class Candidate(Protocol):
    """What the runtime's replica state offers a pick."""

    id: str
    in_flight: int          # requests this proxy has on it now
    running: float          # scraped vllm:num_requests_running
    waiting: float          # scraped vllm:num_requests_waiting
    kv_cache_usage: float   # scraped vllm:kv_cache_usage_perc, 0..1
    metrics_at: float       # time.monotonic() of the last good scrape; 0.0 never


C = TypeVar("C", bound=Candidate)


class UnknownRouting(ValueError):
    """A routing policy name outside `examlops.engine.ROUTINGS`."""


def affinity_key(policy: str, kind: int, body: dict[str, Any], session_id: str) -> str | None:
    """The request's affinity key under `policy`, computed once per request (None: no affinity).

    prefix: a hash of the first `PREFIX_CHARS` of the canonical prompt text; session: `session_id`
    (the ``x-session-id`` header), else ``body["user"]`` when a non-empty string.
    """
    if policy == "prefix":
        text = _chat_text(body.get("messages")) if kind == _CHAT else _prompt_text(
            body.get("prompt") if "prompt" in body else body.get("input"))
        if not text:
            return None
        return blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    if policy == "session":
        if session_id:
            return session_id
        user = body.get("user")
        return user if isinstance(user, str) and user else None
    return None


def _chat_text(messages: Any) -> str:
    """``role NUL text RS`` for each message in order, cut at `PREFIX_CHARS`."""
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        parts.append(role if isinstance(role, str) else "")
        parts.append("\x00")
        size += 2
        if isinstance(content, str):
            parts.append(content[:PREFIX_CHARS - size])   # a long system prompt is not copied whole
            size += len(parts[-1])
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                text = part.get("text")
                piece = text[:PREFIX_CHARS - size] if isinstance(text, str) else f"\x1f{part.get('type')}\x1f"
                parts.append(piece)
                size += len(piece)
                if size >= PREFIX_CHARS:
                    break
        parts.append("\x1e")
        size += 1
        if size >= PREFIX_CHARS:
            break
    return "".join(parts)[:PREFIX_CHARS]


def _prompt_text(prompt: Any) -> str:
    """A completion's prompt (or an embedding's input): a string, the first of a batch, token ids."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS]
    if isinstance(prompt, list):    # token ids: ~4 characters a token
        return ",".join(map(str, prompt[:PREFIX_CHARS // 4]))
    return ""


def _point(text: str) -> int:
    return int.from_bytes(blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class Router:
    """One pool's policy and, for the keyed policies, its hash ring; rebuilt when the pool's ids change."""

    __slots__ = ("_owners", "_points", "_turn", "ids", "policy")

    def __init__(self, policy: str, ids: Sequence[str]) -> None:
        if policy not in ROUTINGS:
            raise UnknownRouting(f"unknown routing policy {policy!r}: use one of {', '.join(ROUTINGS)}")
        self.policy = policy
        self.ids = tuple(ids)
        self._turn = 0
        ring = sorted((_point(f"{rid}#{v}"), rid) for rid in self.ids for v in range(VNODES)) \
            if policy in _KEYED else []
        self._points = [point for point, _ in ring]
        self._owners = [rid for _, rid in ring]

    def pick(self, candidates: Sequence[C], key: str | None, now: float) -> tuple[C, str]:
        """The replica for one attempt. `candidates`: healthy, not draining, not yet tried for this
        request (never empty). Reason: only, least-load, prefix, prefix-overflow, session,
        session-overflow or round-robin."""
        if len(candidates) == 1:
            return candidates[0], "only"
        if self.policy == "round-robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)], "round-robin"
        if key is not None and self._points:
            found = self._ring_pick(candidates, key, now)
            if found is not None:
                return found
        return self._least_load(candidates, now), "least-load"

    def _least_load(self, candidates: Sequence[C], now: float) -> C:
        """Lowest score; scanning from a rotating start so that ties take turns."""
        n = len(candidates)
        self._turn += 1
        start = self._turn % n
        best = candidates[start]
        best_score = _score(best, now)
        for step in range(1, n):
            cand = candidates[(start + step) % n]
            score = _score(cand, now)
            if score < best_score:
                best, best_score = cand, score
        return best

    def _ring_pick(self, candidates: Sequence[C], key: str, now: float) -> tuple[C, str] | None:
        """Walk clockwise from the key's point; the first eligible replica whose load stays within
        the bound after taking this request wins. Stale replicas are eligible only if all are."""
        fresh_after = max(now - STALE_AFTER_S, 0.0)
        loads: dict[str, tuple[C, float]] = {}
        total = 0.0
        for c in candidates:
            if c.metrics_at > fresh_after:
                load = c.in_flight + c.running + c.waiting
                loads[c.id] = (c, load)
                total += load
        if not loads:               # all stale: what this proxy has in flight is all it knows
            for c in candidates:
                loads[c.id] = (c, c.in_flight)
                total += c.in_flight
        bound = math.ceil(LOAD_FACTOR * (total + 1) / len(loads))
        points, owners = self._points, self._owners
        size = len(owners)
        start = bisect(points, _point(key))
        moved = False
        for step in range(size):
            hit = loads.get(owners[(start + step) % size])
            if hit is None:
                continue
            if hit[1] < bound:      # the paper's rule: load after placement ≤ bound
                return hit[0], self.policy + "-overflow" if moved else self.policy
            moved = True
        return None                 # no candidate on this ring (ids changed under it): least-load


def _score(cand: Candidate, now: float) -> float:
    if cand.metrics_at <= max(now - STALE_AFTER_S, 0.0):     # stale or never scraped
        return SATURATED + cand.in_flight
    kv = min(max(cand.kv_cache_usage, 0.0), KV_CLIP)
    return cand.running + cand.waiting + cand.in_flight + kv * kv / (1.0 - kv)
