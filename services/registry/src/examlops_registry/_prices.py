"""The gateway's price table and project attribution of resources.

  {exa:reg}:prices             HASH  model -> Price (protobuf JSON)
  {exa:reg}:price_changes      STREAM kind, model, price  (WatchPrices feed; trimmed to about 10k entries)
  {exa:reg}:project_resources  HASH  "<kind>:<name>" -> ProjectResource (protobuf JSON)

Prices are integers in micro-USD per million tokens (a GPU-hour price: micro-USD per GPU-hour), so
that the gateway's cost arithmetic is exact.
Each change, its change event and its audit event are written in one MULTI/EXEC, like endpoint
records, so WatchPrices (a snapshot, then every change) never misses one. Endpoints
with a project are attributed by RegistryStore.mutate itself (kind serving_endpoint), in the same
transaction as the endpoint record; model versions by VersionStore.register (kind model_version).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import redis.asyncio as redis
from google.protobuf import json_format

from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._checks import refuse_first
from ._store import AUDIT, CHANGES_MAXLEN, PROJECT_RESOURCES, RegistryStore, now_ms, watch_feed

PRICES = "{exa:reg}:prices"
PRICE_CHANGES = "{exa:reg}:price_changes"
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
RESOURCE_KINDS = ("serving_endpoint", "virtual_key", "model_version")
#: 1,000 USD per million tokens: far above any real price, low enough that costs stay exact integers.
MAX_MICRO_USD_PER_MTOK = 1_000 * 1_000_000
#: 10,000 USD per GPU-hour and 4,096 GPUs per server: far above any real price or server.
MAX_MICRO_USD_PER_GPU_HOUR = 10_000 * 1_000_000
MAX_GPUS = 4096


def _json(msg: pb.Price | pb.ProjectResource) -> str:
    return str(json_format.MessageToJson(msg, indent=None, preserving_proto_field_name=True))


def _audit(actor: str, action: str, target: str, before: str, after: str, t: int) -> Any:
    caller, on_behalf_of = current_caller().attribute(actor)
    return cast(Any, RegistryStore._audit_fields(caller, action, target, before, after, t, on_behalf_of))


class PriceStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def set(self, price: pb.Price, actor: str) -> pb.Price:
        out = pb.Price()
        out.CopyFrom(price)
        out.updated_at_ms, out.updated_by = now_ms(), current_caller().name
        before = cast(str | None, await self.r.hget(PRICES, price.model))
        after = _json(out)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(PRICES, price.model, after)
            pipe.xadd(PRICE_CHANGES, {"kind": "put", "price": after}, maxlen=CHANGES_MAXLEN, approximate=True)
            pipe.xadd(AUDIT, _audit(actor, "price.set", f"price:{price.model}", before or "", after,
                                    out.updated_at_ms))
            await pipe.execute()
        return out

    async def remove(self, model: str, actor: str) -> pb.Price | None:
        before = cast(str | None, await self.r.hget(PRICES, model))
        if before is None:
            return None
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(PRICES, model)
            pipe.xadd(PRICE_CHANGES, {"kind": "delete", "price": before}, maxlen=CHANGES_MAXLEN, approximate=True)
            pipe.xadd(AUDIT, _audit(actor, "price.remove", f"price:{model}", before, "", now_ms()))
            await pipe.execute()
        removed = pb.Price()
        json_format.Parse(before, removed)
        return removed

    async def all(self) -> list[pb.Price]:
        raw = await self.r.hgetall(PRICES)
        return sorted((json_format.Parse(v, pb.Price()) for v in raw.values()), key=lambda p: p.model)

    async def watch(self) -> AsyncIterator[pb.PriceEvent]:
        """Snapshot, SYNCED, then every change after the snapshot (at-least-once; each event is idempotent)."""
        async for kind, price in watch_feed(self.r, PRICE_CHANGES, self.all, "price", pb.Price):
            yield pb.PriceEvent(kind=pb.PriceEvent.Kind.Value("KIND_" + kind), price=price)

    async def attribute(self, res: pb.ProjectResource, actor: str) -> pb.ProjectResource:
        out = pb.ProjectResource()
        out.CopyFrom(res)
        out.created_at_ms = now_ms()
        field = f"{res.kind}:{res.name}"
        after = _json(out)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(PROJECT_RESOURCES, field, after)
            pipe.xadd(AUDIT, _audit(actor, "attribute", field, "", after, out.created_at_ms))
            await pipe.execute()
        return out

    async def resources(self, project: str = "", kind: str = "") -> list[pb.ProjectResource]:
        raw = await self.r.hgetall(PROJECT_RESOURCES)
        found = (json_format.Parse(v, pb.ProjectResource()) for v in raw.values())
        return sorted((r for r in found if (not project or r.project == project) and (not kind or r.kind == kind)),
                      key=lambda r: (r.project, r.kind, r.name))


class PricesServicerMixin:
    """SetPrice, ListPrices, RemovePrice, WatchPrices, AttributeResource and ListProjectResources."""

    prices: PriceStore

    async def SetPrice(self, request: pb.SetPriceRequest, context: grpc.aio.ServicerContext) -> pb.Price:
        p = request.price
        problems = [
            ("model", not MODEL_RE.match(p.model), f"invalid model name {p.model!r}: the route name clients send"),
            ("input_micro_usd_per_mtok", not 0 <= p.input_micro_usd_per_mtok <= MAX_MICRO_USD_PER_MTOK,
             f"input price must be between 0 and {MAX_MICRO_USD_PER_MTOK} micro-USD per million tokens"),
            ("output_micro_usd_per_mtok", not 0 <= p.output_micro_usd_per_mtok <= MAX_MICRO_USD_PER_MTOK,
             f"output price must be between 0 and {MAX_MICRO_USD_PER_MTOK} micro-USD per million tokens"),
            ("gpu_hour_micro_usd", not 0 <= p.gpu_hour_micro_usd <= MAX_MICRO_USD_PER_GPU_HOUR,
             f"GPU-hour price must be between 0 and {MAX_MICRO_USD_PER_GPU_HOUR} micro-USD"),
            ("gpus", not 0 <= p.gpus <= MAX_GPUS, f"gpus must be between 0 (the engine block's) and {MAX_GPUS}"),
            ("min_tokens_per_s", not (0 <= p.min_tokens_per_s < float("inf")),
             "min_tokens_per_s must be a positive number of tokens per second"),
            ("min_tokens_per_s", p.gpu_hour_micro_usd > 0 and not p.min_tokens_per_s > 0,
             "a GPU-hour price needs min_tokens_per_s > 0: the slowest throughput a call is billed at, "
             "which bounds what a budget reserves"),
        ]
        for field, bad, message in problems:
            if bad:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_price", message, field)
        return await self.prices.set(p, request.actor)

    async def ListPrices(self, request: pb.ListPricesRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListPricesResponse:
        return pb.ListPricesResponse(prices=await self.prices.all())

    async def RemovePrice(self, request: pb.RemovePriceRequest,
                          context: grpc.aio.ServicerContext) -> pb.RemovePriceResponse:
        removed = await self.prices.remove(request.model, request.actor)
        if removed is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, "price_not_found",
                        f"no price for model {request.model!r}", "model")
        return pb.RemovePriceResponse(removed=removed)

    async def WatchPrices(self, request: pb.WatchPricesRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PriceEvent]:
        async for event in self.prices.watch():
            yield event

    async def AttributeResource(self, request: pb.AttributeResourceRequest,
                                context: grpc.aio.ServicerContext) -> pb.ProjectResource:
        res = request.resource
        problems = [
            ("project", not res.project, "a project resource needs a project"),
            ("kind", res.kind not in RESOURCE_KINDS, f"kind must be one of {', '.join(RESOURCE_KINDS)}"),
            ("name", not res.name, "a project resource needs a name"),
        ]
        await refuse_first(context, "invalid_project_resource", problems)
        return await self.prices.attribute(res, request.actor)

    async def ListProjectResources(self, request: pb.ListProjectResourcesRequest,
                                   context: grpc.aio.ServicerContext) -> pb.ListProjectResourcesResponse:
        return pb.ListProjectResourcesResponse(resources=await self.prices.resources(request.project, request.kind))
