"""Money and prices: integer micro-USD, and the price table followed from the registry's
WatchPrices stream (a snapshot, then every change, so a price set reaches every replica at once;
never a registry call per request).

Rule for a model without a price: it is refused (403 `model_not_priced`) for keys with a budget,
so that no budget is spent on something the gateway cannot count; unbudgeted keys and the admin
key may call it, and its cost records say `priced=0` with a cost of 0.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

MICRO = 1_000_000  # micro-USD per USD; every amount of money is an integer number of micro-USD


@dataclass(frozen=True, slots=True)
class Price:
    input_micro_per_mtok: int    # micro-USD per million prompt tokens
    output_micro_per_mtok: int   # micro-USD per million completion tokens
    gpu_hour_micro: int = 0      # micro-USD per GPU-hour (the gpu-hour cost provider); 0: none
    gpus: int = 0                # GPUs of one server; 0: the endpoint's engine block (TP x PP)
    min_tokens_per_s: float = 0.0  # the slowest throughput a call is billed at (> 0 with gpu_hour_micro)

    @property
    def per_token(self) -> bool:
        """A per-token price: any entry but one that holds only a GPU-hour price."""
        return bool(self.input_micro_per_mtok or self.output_micro_per_mtok or not self.gpu_hour_micro)


class Rates(Protocol):
    """Per-token rates a cost or a reservation is computed from (a Price, or a provider's bound)."""

    @property
    def input_micro_per_mtok(self) -> int: ...
    @property
    def output_micro_per_mtok(self) -> int: ...


def usd_to_micro(usd: float) -> int:
    return round(usd * MICRO)


def cost_micro_usd(prompt_tokens: int, completion_tokens: int, price: Rates | None) -> int:
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

    def replace(self, listed: Iterable[reg.Price]) -> None:
        self.prices = {p.model: _price(p) for p in listed}
        self.synced.set()

    def apply(self, event: reg.PriceEvent) -> None:
        """A change after the snapshot (at-least-once: applying one twice changes nothing)."""
        if event.kind == reg.PriceEvent.KIND_DELETE:
            self.prices.pop(event.price.model, None)
        elif event.kind == reg.PriceEvent.KIND_PUT:
            self.prices[event.price.model] = _price(event.price)


def _price(p: reg.Price) -> Price:
    return Price(p.input_micro_usd_per_mtok, p.output_micro_usd_per_mtok, p.gpu_hour_micro_usd, p.gpus,
                 p.min_tokens_per_s)


async def follow_prices(registry: reg_grpc.RegistryStub, book: PriceBook, resync_s: float) -> None:
    """Keep `book` in step with the registry forever (run it as a task; cancel to stop).

    The watch is re-opened every `resync_s` (its deadline) and starts again with a full snapshot:
    that is the periodic resync. A broken watch is re-opened with back-off; the book keeps its last
    table meanwhile. A registry without WatchPrices is polled with ListPrices every `resync_s`.
    """
    backoff, failing = 0.05, False
    while True:
        synced_now = False
        try:
            await _watch_once(registry, book, resync_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            synced_now = code == grpc.StatusCode.DEADLINE_EXCEEDED and book.synced.is_set()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                synced_now = await _poll_once(registry, book, resync_s)
                await asyncio.sleep(resync_s)
            elif not synced_now and not failing:
                log.warning("price watch broke (%s); keeping %d prices, retrying", code.name, len(book.prices))
        if synced_now:  # the deadline ended a healthy watch: re-open it at once, with a snapshot
            if failing:
                log.info("price table followed again (%d prices)", len(book.prices))
            backoff, failing = 0.05, False
            continue
        failing = True
        await asyncio.sleep(backoff * (1 + random.random() / 2))
        backoff = min(backoff * 2, 2.0)


async def _watch_once(registry: reg_grpc.RegistryStub, book: PriceBook, deadline_s: float) -> None:
    fresh: list[reg.Price] | None = []
    async for event in registry.WatchPrices(reg.WatchPricesRequest(), timeout=deadline_s):
        if fresh is not None and event.kind == reg.PriceEvent.KIND_SNAPSHOT:
            fresh.append(event.price)
        elif fresh is not None and event.kind == reg.PriceEvent.KIND_SYNCED:
            book.replace(fresh)
            fresh = None
        elif fresh is None:
            book.apply(event)


async def _poll_once(registry: reg_grpc.RegistryStub, book: PriceBook, timeout_s: float) -> bool:
    try:
        book.replace((await registry.ListPrices(reg.ListPricesRequest(), timeout=max(timeout_s, 5.0))).prices)
    except grpc.aio.AioRpcError:
        return False
    return True
