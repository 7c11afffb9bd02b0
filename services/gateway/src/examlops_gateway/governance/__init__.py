"""Governance: virtual keys, prices, budgets, rate limits, cost records and the reaper.

Every rule that must hold across replicas runs inside a Lua script (lua/) on Redis' clock; this
package loads them, feeds them named arguments and reads their replies. See GOVERNANCE.md.
"""

from ._budget import Generation, estimate_prompt_tokens, with_max_tokens
from ._cost import GROUPS, spend_summary
from ._errors import Denied, GovernanceUnavailable
from ._governor import Caller, Governor, Ticket, Usage
from ._keycheck import KeyCheck
from ._keys import (
                    ADMIN_ID,
                    ID_LEN,
                    KEY_INDEX,
                    MODEL_RE,
                    KeyLimits,
                    KeyStore,
                    digest,
                    new_key,
                    now_ms,
                    parse_key,
                    public_row,
                    redis_keys,
)
from ._pipe import REDIS_BACKOFF, REDIS_RETRIES, ScriptPipe, pipe_for
from ._prices import MICRO, Price, PriceBook, Rates, cost_micro_usd, follow_prices, usd_to_micro
from ._provider import CallCost, CostProvider, ProviderError, gpus_of, resolve
from ._reaper import Reaper
from ._scripts import Admission, ReserveArgs, SettleArgs, load_script, script_source

__all__ = [
    "ADMIN_ID", "GROUPS", "ID_LEN", "KEY_INDEX", "MICRO", "MODEL_RE", "REDIS_BACKOFF", "REDIS_RETRIES", "Admission",
    "CallCost", "Caller", "CostProvider", "Denied", "Generation", "GovernanceUnavailable", "Governor", "KeyCheck",
    "KeyLimits", "KeyStore", "Price", "PriceBook", "ProviderError", "Rates", "Reaper", "ReserveArgs", "ScriptPipe",
    "SettleArgs", "Ticket", "Usage", "cost_micro_usd", "digest", "estimate_prompt_tokens", "follow_prices",
    "gpus_of", "load_script", "new_key", "now_ms", "parse_key", "pipe_for", "public_row", "redis_keys", "resolve",
    "script_source", "spend_summary", "usd_to_micro", "with_max_tokens",
]
