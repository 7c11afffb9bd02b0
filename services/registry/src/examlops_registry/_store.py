"""Endpoint records, change events and audit events in Redis.

Keys share the `{exa:reg}` hash tag so every multi-key transaction runs on Redis Cluster too:
  {exa:reg}:endpoints  HASH   name -> Endpoint (protobuf JSON)
  {exa:reg}:changes    STREAM kind, name, endpoint   (watch feed; trimmed to about 10k entries)
  {exa:reg}:audit      STREAM actor, action, target, before, after, time_ms, on_behalf_of  (append-only)
  {exa:reg}:project_resources  HASH "serving_endpoint:<name>" -> ProjectResource (protobuf JSON)
A mutation writes the record, its change event, its audit event and the endpoint's project
attribution in one MULTI/EXEC guarded by WATCH, so none exists without the others.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
from google.protobuf import json_format
from google.protobuf.message import Message
from redis.exceptions import WatchError

from examlops.registry.v1 import registry_pb2 as pb

ENDPOINTS = "{exa:reg}:endpoints"
CHANGES = "{exa:reg}:changes"
AUDIT = "{exa:reg}:audit"
PROJECT_RESOURCES = "{exa:reg}:project_resources"
CHANGES_MAXLEN = 10_000


class NotFound(KeyError):
    pass


class Conflict(ValueError):
    pass


def now_ms() -> int:
    return time.time_ns() // 1_000_000


M = TypeVar("M", bound=Message)


def to_json(msg: Message) -> str:
    """A record as stored: one-line protobuf JSON with the proto's field names."""
    return str(json_format.MessageToJson(msg, indent=None, preserving_proto_field_name=True))


def from_json(raw: str | bytes, cls: type[M]) -> M:
    msg: M = cls()
    json_format.Parse(raw, msg)
    return msg


Mutation = Callable[[pb.Endpoint | None], pb.Endpoint | None]


class RegistryStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def get(self, name: str) -> pb.Endpoint:
        raw = await self.r.hget(ENDPOINTS, name)
        if raw is None:
            raise NotFound(name)
        return from_json(raw, pb.Endpoint)

    async def list(self) -> list[pb.Endpoint]:
        raw = await self.r.hgetall(ENDPOINTS)
        return sorted((from_json(v, pb.Endpoint) for v in raw.values()), key=lambda e: e.name)

    async def mutate(self, name: str, change: Mutation, actor: str, action: str,
                     on_behalf_of: str = "") -> pb.Endpoint | None:
        """Apply `change(before) -> after` atomically (None deletes); returns `after`."""
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(ENDPOINTS)
                    raw = await pipe.hget(ENDPOINTS, name)
                    before = from_json(raw, pb.Endpoint) if raw is not None else None
                    after = change(before)
                    t = now_ms()
                    before_json = to_json(before) if before is not None else ""
                    pipe.multi()
                    if after is None:
                        if before is None:
                            raise NotFound(name)
                        pipe.hdel(ENDPOINTS, name)
                        pipe.xadd(CHANGES, {"kind": "delete", "name": name, "endpoint": before_json},
                                  maxlen=CHANGES_MAXLEN, approximate=True)
                        after_json = ""
                    else:
                        after.updated_at_ms = t
                        after.created_at_ms = before.created_at_ms if before is not None else t
                        after.revision = (before.revision if before is not None else 0) + 1
                        after_json = to_json(after)
                        pipe.hset(ENDPOINTS, name, after_json)
                        pipe.xadd(CHANGES, {"kind": "put", "name": name, "endpoint": after_json},
                                  maxlen=CHANGES_MAXLEN, approximate=True)
                    pipe.xadd(AUDIT, self._audit_fields(actor, action, f"endpoint:{name}",
                                                        before_json, after_json, t, on_behalf_of))
                    self._attribute(pipe, name, after)
                    await pipe.execute()
                    return after
                except WatchError:
                    continue

    @staticmethod
    def _attribute(pipe: redis.client.Pipeline, name: str, after: pb.Endpoint | None) -> None:
        """Record the endpoint as its project's resource (kind serving_endpoint), or forget it."""
        field = f"serving_endpoint:{name}"
        if after is None or not after.project:
            pipe.hdel(PROJECT_RESOURCES, field)
            return
        res = pb.ProjectResource(project=after.project, kind="serving_endpoint", name=name,
                                 created_at_ms=after.created_at_ms)
        pipe.hset(PROJECT_RESOURCES, field, json_format.MessageToJson(res, indent=None,
                                                                      preserving_proto_field_name=True))

    @staticmethod
    def _audit_fields(actor: str, action: str, target: str, before: str, after: str, t: int,
                      on_behalf_of: str = "") -> dict[str, str]:
        fields = {"actor": actor or "unknown", "action": action, "target": target,
                  "before": before, "after": after, "time_ms": str(t)}
        if on_behalf_of:
            fields["on_behalf_of"] = on_behalf_of
        return fields

    async def record_audit(self, ev: pb.AuditEvent) -> pb.AuditEvent:
        t = ev.time_ms or now_ms()
        event_id = await self.r.xadd(AUDIT, self._audit_fields(
            ev.actor, ev.action, ev.target, ev.before_json, ev.after_json, t, ev.on_behalf_of))
        out = pb.AuditEvent()
        out.CopyFrom(ev)
        out.id, out.time_ms = _s(event_id), t
        return out

    async def list_audit(self, limit: int, target: str = "", action: str = "") -> builtins.list[pb.AuditEvent]:
        """Newest first, filtered; scans back in pages until `limit` matches are found."""
        out: list[pb.AuditEvent] = []
        end = "+"
        while len(out) < limit:
            page = await self.r.xrevrange(AUDIT, max=end, count=max(limit, 200))
            if not page:
                break
            for event_id, f in page:
                fields = {_s(k): _s(v) for k, v in f.items()}
                if (target and fields["target"] != target) or (action and fields["action"] != action):
                    continue
                out.append(pb.AuditEvent(
                    id=_s(event_id), actor=fields["actor"], action=fields["action"],
                    target=fields["target"], before_json=fields["before"], after_json=fields["after"],
                    time_ms=int(fields["time_ms"]), on_behalf_of=fields.get("on_behalf_of", "")))
                if len(out) == limit:
                    break
            end = "(" + _s(page[-1][0])
        return out

    async def watch(self) -> AsyncIterator[pb.EndpointEvent]:
        """Snapshot, SYNCED, then every change after the snapshot (at-least-once; PUTs are idempotent)."""
        async for kind, ep in watch_feed(self.r, CHANGES, self.list, "endpoint", pb.Endpoint):
            yield pb.EndpointEvent(kind=pb.EndpointEvent.Kind.Value("KIND_" + kind), endpoint=ep)


async def watch_feed(r: Any, stream: str, records: Callable[[], Awaitable[builtins.list[M]]], field: str,
                     cls: type[M]) -> AsyncIterator[tuple[str, M | None]]:
    """A watch's events: (SNAPSHOT, record) for each record, (SYNCED, None), then (PUT or DELETE, record)
    for every entry of the change `stream` (whose `field` holds the record) appended after the snapshot
    began, forever. At-least-once: a change made during the snapshot comes again after it."""
    last = await r.xrevrange(stream, count=1)
    cursor = _s(last[0][0]) if last else "0-0"
    for record in await records():
        yield "SNAPSHOT", record
    yield "SYNCED", None
    while True:
        batches = await r.xread({stream: cursor}, block=10_000, count=256)
        for _stream, entries in batches or ():
            for event_id, f in entries:
                cursor = _s(event_id)
                fields = {_s(k): _s(v) for k, v in f.items()}
                yield "DELETE" if fields["kind"] == "delete" else "PUT", from_json(fields[field], cls)


def _s(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v
