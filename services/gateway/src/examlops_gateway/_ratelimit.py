"""Rate limits per virtual key: requests per minute and tokens per minute, shared by every replica.

Both are GCRA (generic cell rate algorithm) in reserve.lua, on Redis' clock, in the same atomic
step as the budget reservation. A limit of N per minute admits a burst of N and then N per minute:
in any window of W seconds at most N + N*W/60 are admitted, whatever the number of replicas or
workers, because the state (the theoretical arrival time, `rpm_tat` / `tpm_tat`) lives only in
Redis.

Tokens per minute are charged before dispatch at the request's bound (prompt bound + n x max_tokens,
see _budget.py), and settle.lua gives back the unused part, but never more than what of that
reservation is still in the bucket: a refund cannot make room that other calls' tokens occupy, so
the bound above holds for the real token counts. A request whose own bound exceeds the key's TPM
gets its max_tokens lowered to fit; if even its prompt does not fit, it is refused for good.
"""

from __future__ import annotations

import math

from ._errors import OpenAIError


def rate_limit_error(code: str, detail: str, key_id: str) -> OpenAIError:
    """429 rate_limit_exceeded; Retry-After (seconds) tells when the bucket has room again."""
    if code == "tpm_too_small":
        return OpenAIError(429, f"the prompt alone is larger than the tokens-per-minute limit ({detail}) of "
                                f"key {key_id}: shorten it, or raise the key's --tpm",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"x-should-retry": "false"})
    retry_s = max(1, math.ceil(int(detail or "0") / 1000))
    what = "requests" if code == "rpm_exceeded" else "tokens"
    return OpenAIError(429, f"{what}-per-minute limit of key {key_id} reached; retry in {retry_s} s",
                       type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry_s)})
