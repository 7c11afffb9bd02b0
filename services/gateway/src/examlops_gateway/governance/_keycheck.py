"""The key check before a body is read: does this virtual key exist, and is it valid now?

A generation's body is read and parsed only for a key that checks out, so a well-formed fake key
costs one small Redis call (key_models.lua: `check_key`, the same check reserve.lua runs, on the
same clock) and no body read. Answers are kept in process, keyed by the key's hash, for `ttl_s`:

- valid: reserve.lua still judges every call, so a key revoked or expired meanwhile has at most
  `ttl_s` of bodies read before its calls are refused as they always were;
- unknown or revoked (states that never become valid again): one fake key sent again and again
  costs one Redis call per `ttl_s`. Expired keys are not kept, as an operator may extend them.

Each of the two caches holds at most `size` keys (least recently used out first), and they are
apart, so a flood of distinct fake keys pushes out only other fake keys, never a valid one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, TypeVar

import redis.asyncio as redis

from ._errors import GovernanceUnavailable
from ._governor import Caller
from ._keys import redis_keys
from ._scripts import Reply, load_script, refusal

V = TypeVar("V")
_FOREVER_INVALID = ("invalid_api_key", "key_revoked")


class _Recent(Generic[V]):
    """A bounded map whose entries live `ttl_s` (least recently used out first when full)."""

    def __init__(self, ttl_s: float, size: int) -> None:
        self.ttl_s, self.size = ttl_s, size
        self._items: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] <= time.monotonic():
            del self._items[key]
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: str, value: V) -> None:
        self._items[key] = (time.monotonic() + self.ttl_s, value)
        self._items.move_to_end(key)
        if len(self._items) > self.size:
            self._items.popitem(last=False)


class KeyCheck:
    """Refuses a virtual key that is not valid before its request body is read (Denied, as reserve.lua would)."""

    def __init__(self, client: redis.Redis, ttl_s: float, size: int) -> None:
        self.script = load_script(client, "key_models.lua")
        self.valid: _Recent[bool] = _Recent(ttl_s, size)
        self.invalid: _Recent[Reply] = _Recent(ttl_s, size)

    async def check(self, caller: Caller) -> None:
        """Returns when the key is valid (the admin key is); raises Denied (401) or GovernanceUnavailable (503)."""
        key_id, key_hash = caller.key_id, caller.key_hash
        if caller.admin or self.valid.get(key_hash):
            return
        reply = self.invalid.get(key_hash)
        if reply is None:
            try:
                reply = await self.script(keys=redis_keys(key_id)[:1], args=[key_hash])
            except redis.RedisError as exc:
                raise GovernanceUnavailable(exc) from None
            if reply[0] == "ok":
                self.valid.put(key_hash, True)
                return
            if reply[1] in _FOREVER_INVALID:
                self.invalid.put(key_hash, reply)
        raise refusal(reply, key_id, "")  # counted by reason, as every refusal
