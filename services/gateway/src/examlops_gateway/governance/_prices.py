"""Money and prices: integer micro-USD, and the price table followed from the registry by a
periodic ListPrices (never per request).

Rule for a model without a price: it is refused (403 `model_not_priced`) for keys with a budget,
so that no budget is spent on something the gateway cannot count; unbudgeted keys and the admin
key may call it, and its cost records say `priced=0` with a cost of 0.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

MICRO = 1_000_000  # micro-USD per USD; every amount of money is an integer number of micro-USD


@dataclass(frozen=True, slots=True)
class Price:
    input_micro_per_mtok: int    # micro-USD per million prompt tokens
    output_micro_per_mtok: int   # micro-USD per million completion tokens


def usd_to_micro(usd: float) -> int:
    return round(usd * MICRO)


def cost_micro_usd(prompt_tokens: int, completion_tokens: int, price: Price | None) -> int:
    """Exact integer cost, rounded up to the next micro-USD (never under-charged); 0 when unpriced."""
    if price is None:
        return 0
    num = prompt_tokens * price.input_micro_per_mtok + completion_tokens * price.output_micro_per_mtok
    return -(-num // MICRO)


@dataclass(slots=True)
class PriceBook:
    prices: dict[str, Price] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    def get(self, model: str) -> Price | None:
        return self.prices.get(model)

    def replace(self, listed: list[reg.Price]) -> None:
        self.prices = {p.model: Price(p.input_micro_usd_per_mtok, p.output_micro_usd_per_mtok) for p in listed}
        self.synced.set()


async def follow_prices(registry: reg_grpc.RegistryStub, book: PriceBook, interval_s: float) -> None:
    """Refresh `book` every `interval_s` forever; a failed fetch keeps the last table."""
    failing = False
    while True:
        try:
            resp = await registry.ListPrices(reg.ListPricesRequest(), timeout=max(interval_s, 5.0))
            book.replace(list(resp.prices))
            if failing:
                log.info("price table fetched again (%d prices)", len(book.prices))
            failing = False
        except grpc.aio.AioRpcError as exc:
            if not failing:
                log.warning("cannot fetch prices from the registry (%s); keeping %d prices",
                            exc.code().name, len(book.prices))
            failing = True
        await asyncio.sleep(interval_s if not failing else min(interval_s, 1.0))
