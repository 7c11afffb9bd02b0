"""Cost providers for the gateway's EXAMLOPS_LLM_COST_PROVIDER=module:Class tests (tests/test_cost_provider.py).

They run inside the gateway process, which imports them from this installed package. With
EXAMLOPS_TEST_COST_LOG set, each call a provider prices is appended to that file as one JSON line
(the CallCost it was given, and the USD it answered), so a test can check what the provider saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

FEE_USD = 0.0005            # PerCallFee: per call ...
PER_TOKEN_USD = 1e-6        # ... plus this per token (prompt or completion)


def _log(call: Any, usd: float) -> None:
    path = os.environ.get("EXAMLOPS_TEST_COST_LOG")
    if path:
        row = {k: v for k, v in dataclasses.asdict(call).items() if k != "price"}
        with open(path, "a") as f:
            f.write(json.dumps({**row, "usd": usd}) + "\n")


class PerCallFee:
    """A flat fee per call plus a price per token. No `rates`: the registry's per-token price bounds
    the reservation, so on a budgeted key the fee is clamped to what was reserved."""

    def cost(self, call: Any) -> float:
        usd = FEE_USD + (call.prompt_tokens + call.completion_tokens) * PER_TOKEN_USD
        _log(call, usd)
        return usd


class NotAProvider:
    """A class without cost(): the gateway refuses to start with it."""
