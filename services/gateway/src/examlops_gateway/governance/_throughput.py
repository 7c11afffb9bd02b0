"""A server's recent token throughput, for the gpu-hour cost provider (GOVERNANCE.md, "Cost providers").

Source: the calls every gateway replica settles, in Redis (lua/throughput.lua, one round trip per
settle, on Redis' clock): each call's prompt + completion tokens are spread evenly over the seconds
it ran, per endpoint and replica; the throughput is the tokens of the last EXAMLOPS_COST_WINDOW_S
seconds divided by the server's busy time in them (per second: from the first start to the last end
of the calls in it), so idle time does not dilute it. Traffic that bypasses the gateway, and calls
still in flight, are not seen: the calls it sees pay for that GPU time (GOVERNANCE.md says how much).
"""

from __future__ import annotations

import logging

import redis.asyncio as redis

from ._scripts import load_script

log = logging.getLogger(__name__)


def throughput_key(endpoint: str, replica: str) -> str:
    return f"{{exa:tput}}:{endpoint}:{replica}"


class Throughput:
    def __init__(self, client: redis.Redis, window_s: int) -> None:
        self.window_s = window_s
        self.script = load_script(client, "throughput.lua")
        self.last: dict[tuple[str, str], float] = {}   # the last answer per server, for progress notes

    async def observe(self, endpoint: str, replica: str, tokens: int, duration_s: float) -> float:
        """Add a settled call's tokens; the server's tokens per busy second, this call included
        (0 when Redis does not answer: the call is then billed as if it ran alone)."""
        try:
            reply = await self.script(keys=[throughput_key(endpoint, replica)],
                                      args=[tokens, f"{max(duration_s, 0.0):.6f}", self.window_s])
        except redis.RedisError as exc:
            log.warning("cannot read the throughput of %s/%s (%s); billing the call as if alone", endpoint,
                        replica or "-", exc)
            return 0.0
        tps = float(reply)
        self.last[endpoint, replica] = tps
        return tps
