"""The `model` detector: a registered route used as a safety judge (placeholder until the judge lands)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ._detectors import Finding

Ask = Callable[[str, bytes, float], Awaitable[bytes]]


class JudgeError(Exception):
    """The judge failed, timed out or answered something other than safe/unsafe."""


class ModelJudge:
    def __init__(self, route: str, ask: Ask, timeout_s: float = 5.0) -> None:
        self.route, self._ask, self.timeout_s = route, ask, timeout_s

    async def scan(self, text: str) -> list[Finding]:
        raise JudgeError("not implemented yet")
