"""Governance's refusals, typed; the HTTP layer turns them into OpenAI-shaped errors."""

from __future__ import annotations

import math


class Denied(Exception):
    """The key check, the allow-list, the budget or a rate limit said no (reserve.lua, key_models.lua).

    `code` is the script's reason: invalid_api_key, key_revoked, key_expired, model_not_allowed,
    model_not_priced, budget_exceeded, tpm_too_small, rpm_exceeded or tpm_exceeded; `detail` is the
    script's detail string, read through the properties below.
    """

    def __init__(self, code: str, detail: str, *, key_id: str, model: str) -> None:
        super().__init__(code)
        self.code, self.detail, self.key_id, self.model = code, detail, key_id, model

    @property
    def allowed(self) -> list[str]:
        """model_not_allowed: the key's models."""
        return [m for m in self.detail.split(",") if m]

    @property
    def left_micro(self) -> int:
        """budget_exceeded: micro-USD left on the key."""
        return max(int(self.detail or "0"), 0)

    @property
    def retry_after_s(self) -> int:
        """rpm_exceeded, tpm_exceeded: whole seconds until the bucket has room."""
        return max(1, math.ceil(int(self.detail or "0") / 1000))


class GovernanceUnavailable(Exception):
    """The governance store (Redis) cannot be reached: virtual keys fail closed."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(type(cause).__name__)
        self.cause_name = type(cause).__name__
