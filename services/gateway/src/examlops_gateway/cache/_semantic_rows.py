"""One (space, dimension)'s rows of the semantic index: a float32 matrix searched with one product.

Rows are appended; a removed row keeps its place with expiry 0 (so it never matches) until the
matrix is rebuilt: when it is full (doubling, or compacting when a quarter of it is dead) or when
the owner asks (`maybe_compact`). Capacity stays under about 2.7 x the live rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SpaceRows"]


class SpaceRows:
    """One (space, dimension)'s vectors as one float32 matrix; appended rows, removed rows expire at 0."""

    __slots__ = ("_row", "dim", "expires", "ids", "key", "live", "n", "vectors")

    def __init__(self, key: tuple[str, int], capacity: int = 16) -> None:
        self.key, self.dim = key, key[1]
        self.vectors = np.zeros((capacity, self.dim), np.float32)
        self.expires = np.zeros(capacity, np.int64)  # wall clock ms; 0 for a removed row
        self.ids: list[str | None] = []
        self._row: dict[str, int] = {}
        self.n = self.live = 0

    def append(self, entry_id: str, vector: np.ndarray, expires: int) -> None:
        if self.n == self.vectors.shape[0]:
            dead = self.n - self.live
            self._rebuild(max(16, 2 * self.live) if dead * 4 >= self.n else 2 * self.n)
        self.vectors[self.n] = vector
        self.expires[self.n] = expires
        self.ids.append(entry_id)
        self._row[entry_id] = self.n
        self.n += 1
        self.live += 1

    def remove(self, entry_id: str) -> None:
        row = self._row.pop(entry_id)
        self.expires[row] = 0
        self.ids[row] = None
        self.live -= 1

    def expires_of(self, entry_id: str) -> int:
        return int(self.expires[self._row[entry_id]])

    def entry_ids(self) -> list[str]:
        return list(self._row)

    def expired(self, now_ms: int) -> list[str]:
        ends = self.expires[:self.n]
        return [self.ids[r] or "" for r in np.flatnonzero((ends > 0) & (ends <= now_ms))]

    def maybe_compact(self) -> None:
        """Drop removed rows once they are a quarter of the matrix (and shrink it with the live set)."""
        dead = self.n - self.live
        if dead >= 16 and dead * 4 >= self.n:
            self._rebuild(max(16, 2 * self.live))

    def _rebuild(self, capacity: int) -> None:
        keep = np.flatnonzero(self.expires[:self.n] > 0)
        vectors = np.zeros((capacity, self.dim), np.float32)
        expires = np.zeros(capacity, np.int64)
        vectors[:keep.size] = self.vectors[keep]
        expires[:keep.size] = self.expires[keep]
        self.ids = [self.ids[r] for r in keep]
        self._row = {entry_id: row for row, entry_id in enumerate(self.ids) if entry_id is not None}
        self.vectors, self.expires, self.n = vectors, expires, int(keep.size)

