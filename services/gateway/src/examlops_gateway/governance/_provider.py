"""Cost providers: how a call's cost is computed (EXAMLOPS_LLM_COST_PROVIDER; GOVERNANCE.md, "Cost providers").

  prices        the registry's per-token prices (the default):
                  cost = ceil((prompt x input + completion x output) / 1e6) micro-USD
  gpu-hour      the endpoint's GPU-hour price and GPU count, apportioned by the call's share of its
                server's token throughput:
                  cost = gpu_hour x gpus x tokens / max(server_tps, tokens / duration, min_tps) / 3600
  module:Class  an importable class with `cost(call: CallCost) -> float` (USD); see CostProvider.

Each provider gives two things: the per-token rates a reservation is built from (an upper bound of
what its settle can charge, so that reserve.lua can lower max_tokens to what a budget pays for) and
the cost of a settled call. The reservation and the settle of a call use the same provider, the price
entry and GPU count read at admission. The provider is resolved once per process (`resolve`).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from examlops.registry.v1 import registry_pb2 as reg

from ._prices import MICRO, Price, Rates, cost_micro_usd

if TYPE_CHECKING:
    from ._governor import Ticket

log = logging.getLogger(__name__)

PRICES, GPU_HOUR = "prices", "gpu-hour"
SECONDS_PER_HOUR = 3600


@dataclass(frozen=True, slots=True)
class TokenRates:
    """Per-token rates in micro-USD per million tokens (a reservation's bound)."""

    input_micro_per_mtok: int
    output_micro_per_mtok: int


@dataclass(frozen=True, slots=True)
class CallCost:
    """What a provider knows of a call: at settle, and at admission for `rates` (tokens and duration 0,
    project '': the key's project is read in the same atomic step as the reservation)."""

    endpoint: str                 # the route name the call went to
    model: str                    # as the client sent it (the route name)
    project: str                  # the virtual key's project ('' for the admin key)
    key_id: str                   # the virtual key's id ('admin' for the admin key)
    prompt_tokens: int
    completion_tokens: int
    duration_s: float             # admission to settle (the record's latency_ms / 1000)
    price: Price | None           # the registry's price entry for the route, as at admission
    gpus: int                     # GPUs of one server: the entry's gpus, else the engine block's TP x PP
    replica: str = ""             # the replica that answered ('' unknown)
    server_tokens_per_s: float = 0.0  # the server's recent throughput (when the provider uses it)
    status: str = "200"           # the HTTP status of the call (499: the client left)
    estimated: bool = False       # the token counts are the gateway's bound, not the engine's usage


@runtime_checkable
class CostProvider(Protocol):
    """What a `module:Class` provider implements (constructed once, with no arguments).

    `cost(call)`: the call's cost in USD (>= 0). Optional: `rates(call) -> (input, output) | None`,
    upper bounds in USD per million tokens for the reservation (None: the model is unpriced); without
    it the registry's per-token price is the bound. Optional: `uses_throughput = True` fills
    `call.server_tokens_per_s` (one more Redis round trip per settle).
    A cost above the call's reservation is clamped to it and the difference recorded (`clamped`).
    """

    def cost(self, call: CallCost) -> float: ...


class Costing:
    """A resolved provider, as the governor uses it (the `prices` provider itself)."""

    name: str = PRICES
    uses_gpus = False          # admission reads the endpoint's GPU count
    uses_throughput = False    # the settle measures the server's throughput (_throughput.py)
    clamps = False             # a cost above the reservation is clamped to it

    def rates(self, price: Price | None, gpus: int, endpoint: str, key_id: str) -> Rates | None:
        """The reservation's per-token bound; None: the model is unpriced for this provider."""
        return price if price is not None and price.per_token else None

    def charge(self, t: Ticket, prompt: int, completion: int, spent: Spent) -> tuple[int, str]:
        """(cost in micro-USD, basis: how it was computed, for the cost record)."""
        return cost_micro_usd(prompt, completion, t.rates), ""


@dataclass(frozen=True, slots=True)
class Spent:
    """What a settle knows beyond the tokens."""

    duration_s: float
    server_tokens_per_s: float
    status: str
    estimated: bool


class GpuHourCosting(Costing):
    name = GPU_HOUR
    uses_gpus = True
    uses_throughput = True

    def rates(self, price: Price | None, gpus: int, endpoint: str, key_id: str) -> Rates | None:
        if price is None or price.gpu_hour_micro <= 0:
            return None if price is None or price.per_token else _FREE
        per_mtok = math.ceil(price.gpu_hour_micro * gpus * 1_000_000 / (SECONDS_PER_HOUR * price.min_tokens_per_s))
        return TokenRates(per_mtok, per_mtok)

    def charge(self, t: Ticket, prompt: int, completion: int, spent: Spent) -> tuple[int, str]:
        p, tokens = t.price, prompt + completion
        if p is None or p.gpu_hour_micro <= 0 or tokens <= 0:
            return 0, ""
        billed = max(spent.server_tokens_per_s, p.min_tokens_per_s,
                     tokens / spent.duration_s if spent.duration_s > 0 else 0.0)
        micro = math.ceil(p.gpu_hour_micro * t.gpus * tokens / billed / SECONDS_PER_HOUR * (1 - 1e-12))
        return micro, (f"gpus={t.gpus};server_tokens_per_s={spent.server_tokens_per_s:.6f};"
                       f"billed_tokens_per_s={billed:.6f}")


_FREE = TokenRates(0, 0)  # gpu-hour: an entry with every price 0 is free, as under `prices`


class CustomCosting(Costing):
    clamps = True
    uses_gpus = True

    def __init__(self, spec: str, provider: Any) -> None:
        self.name, self.provider = spec, provider
        self.uses_throughput = bool(getattr(provider, "uses_throughput", False))
        self._rates = getattr(provider, "rates", None)

    def rates(self, price: Price | None, gpus: int, endpoint: str, key_id: str) -> Rates | None:
        if self._rates is None:
            return super().rates(price, gpus, endpoint, key_id)
        try:
            got = self._rates(CallCost(endpoint=endpoint, model=endpoint, project="", key_id=key_id,
                                       prompt_tokens=0, completion_tokens=0, duration_s=0.0, price=price, gpus=gpus))
            if got is None:
                return None
            inp, out = (float(x) for x in got)
            if not (math.isfinite(inp) and math.isfinite(out) and inp >= 0 and out >= 0):
                raise ValueError(f"rates {got!r}: give two finite numbers >= 0 (USD per million tokens)")
        except Exception:  # the provider's bug must not fail the call: the registry's price bounds it
            log.exception("cost provider %s failed to give rates; using the per-token price", self.name)
            return super().rates(price, gpus, endpoint, key_id)
        return TokenRates(math.ceil(inp * MICRO), math.ceil(out * MICRO))

    def charge(self, t: Ticket, prompt: int, completion: int, spent: Spent) -> tuple[int, str]:
        call = CallCost(endpoint=t.model, model=t.model, project=t.project, key_id=t.caller.key_id,
                        prompt_tokens=prompt, completion_tokens=completion, duration_s=spent.duration_s,
                        price=t.price, gpus=t.gpus, replica=t.replica,
                        server_tokens_per_s=spent.server_tokens_per_s, status=spent.status,
                        estimated=spent.estimated)
        try:
            usd = float(self.provider.cost(call))
            if not math.isfinite(usd) or usd < 0:
                raise ValueError(f"returned {usd!r} USD; a cost is a finite number >= 0")
        except Exception:  # the call is settled anyway: at its bound rates, and the record says so
            log.exception("cost provider %s failed on a call of %s; charging its bound", self.name, t.model)
            return cost_micro_usd(prompt, completion, t.rates), "provider-error"
        return math.ceil(usd * MICRO * (1 - 1e-12)), ""


def gpus_of(endpoint: reg.Endpoint | None, price: Price | None) -> int:
    """GPUs of one server of the endpoint: the price entry's `gpus` when set, else the engine block's
    tensor_parallel_size x pipeline_parallel_size (1 x 1 when the block says nothing)."""
    if price is not None and price.gpus > 0:
        return price.gpus
    if endpoint is None:
        return 1
    return _block_gpus(endpoint.engine_block_json)


@lru_cache(maxsize=1024)
def _block_gpus(block_json: str) -> int:
    try:
        block = json.loads(block_json) if block_json else {}
    except ValueError:
        return 1
    if not isinstance(block, dict):
        return 1
    tp, pp = block.get("tensor_parallel_size") or 1, block.get("pipeline_parallel_size") or 1
    return int(tp) * int(pp) if isinstance(tp, int) and isinstance(pp, int) else 1


class ProviderError(ValueError):
    """EXAMLOPS_LLM_COST_PROVIDER names no usable provider (the message says how to fix it)."""


@cache
def resolve(spec: str) -> Costing:
    """The provider `spec` names, built once per process; raises ProviderError."""
    if spec == PRICES:
        return Costing()
    if spec == GPU_HOUR:
        return GpuHourCosting()
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ProviderError(f"must be {PRICES!r}, {GPU_HOUR!r} or 'module:Class' (an importable class with a "
                            "cost(call) method, see services/gateway/GOVERNANCE.md)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import runs the module: any error is the module's
        raise ProviderError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc}); install it "
                            "or put it on the gateway's PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ProviderError(f"module {module_name!r} has no class {class_name!r}")
    try:
        provider = cls()
    except Exception as exc:
        raise ProviderError(f"{spec}() failed ({type(exc).__name__}: {exc}); a provider is built with no "
                            "arguments (read its settings from the environment)") from None
    if not callable(getattr(provider, "cost", None)):
        raise ProviderError(f"{spec} has no cost(call) method returning USD (see CostProvider in "
                            "services/gateway/GOVERNANCE.md)")
    return CustomCosting(spec, provider)
