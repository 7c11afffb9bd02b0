"""The in-memory route table, fed by the registry's watch stream.

The gateway and engine-proxy never call the registry on the request path: they hold this table
and keep it current from `WatchEndpoints`. A broken watch is re-opened with back-off; the table
keeps serving its last known state meanwhile (a registry outage does not stop traffic), and each
re-opened watch starts with a full snapshot, which is the periodic resync.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from examlops.registry.v1 import registry_pb2 as pb
from examlops.registry.v1 import registry_pb2_grpc as pb_grpc

from ._grpc import insecure_channel

log = logging.getLogger(__name__)

Endpoint = pb.Endpoint
Replica = pb.Replica
S = pb.EndpointState

#: Engines that answer without a server address.
ADDRESSLESS_ENGINES = frozenset({"echo", "vllm-inproc"})
#: States that are never routed, whatever the address.
UNROUTED_STATES = frozenset({S.ENDPOINT_STATE_STOPPED, S.ENDPOINT_STATE_DISABLED})


def state_name(state: int) -> str:
    """`ENDPOINT_STATE_READY` → `READY`."""
    return str(pb.EndpointState.Name(state)).removeprefix("ENDPOINT_STATE_")  # type: ignore[arg-type,unused-ignore]


def parse_state(name: str) -> int:
    """`ready` or `READY` → the enum value; ValueError naming the accepted states otherwise."""
    key = "ENDPOINT_STATE_" + name.strip().upper()
    if key not in pb.EndpointState.keys() or key.endswith("UNSPECIFIED"):  # noqa: SIM118 (enum wrapper)
        accepted = ", ".join(state_name(v) for v in pb.EndpointState.values() if v)
        raise ValueError(f"unknown state {name!r}; accepted: {accepted}")
    return int(pb.EndpointState.Value(key))


def replica_routable(replica: Replica) -> bool:
    """A replica takes new requests: it has an address, is not draining, and is not stopped or disabled."""
    return bool(replica.base_url) and not replica.draining and replica.state not in UNROUTED_STATES


def routable_replicas(ep: Endpoint) -> list[Replica]:
    """The replicas a new request to `ep` may go to, in pool order; none when the endpoint is unrouted.

    A record with no replicas at all (stored before pools existed) is its own single replica r0.
    """
    if ep.state in UNROUTED_STATES:
        return []
    if not ep.replicas:
        legacy = Replica(id="r0", base_url=ep.base_url, state=ep.state, job_id=ep.job_id)
        return [legacy] if replica_routable(legacy) else []
    return [r for r in ep.replicas if replica_routable(r)]


def unroutable_reason(ep: Endpoint) -> str | None:
    """Why an endpoint is not routed, or None when it is.

    PENDING, STARTING and FAILED endpoints with an address are routed: a request to a server that
    is down answers AllBackendsFailed, which says more than "not found" and recovers by itself.
    """
    if ep.state in UNROUTED_STATES:
        return f"endpoint {ep.name!r} is {state_name(ep.state)}"
    if ep.engine in ADDRESSLESS_ENGINES or routable_replicas(ep):
        return None
    if any(r.base_url for r in ep.replicas):
        why = ", ".join(f"{r.id} {'draining' if r.draining else state_name(r.state)}"
                        for r in ep.replicas if r.base_url)
        return f"endpoint {ep.name!r} has no routable replica ({why})"
    return f"endpoint {ep.name!r} has no address yet (state {state_name(ep.state)})"


@dataclass(slots=True)
class RouteTable:
    """Endpoints by name, as last seen on the watch."""

    endpoints: dict[str, Endpoint]
    synced: asyncio.Event

    @classmethod
    def empty(cls) -> RouteTable:
        return cls(endpoints={}, synced=asyncio.Event())

    def get(self, name: str) -> Endpoint | None:
        return self.endpoints.get(name)

    def routable(self) -> list[Endpoint]:
        return [ep for ep in self.endpoints.values() if unroutable_reason(ep) is None]


async def watch_routes(
    registry_addr: str,
    table: RouteTable,
    on_change: Callable[[Endpoint, bool], None] | None = None,
    max_backoff_s: float = 2.0,
    *,
    token: str,
) -> None:
    """Keep `table` in step with the registry forever (run it as a task; cancel to stop).

    `on_change(endpoint, deleted)` is called for every change after the snapshot; `token` is the
    caller's EXAMLOPS_SERVICE_TOKEN.
    """
    backoff = 0.05
    while True:
        channel = insecure_channel(registry_addr, token)
        try:
            stub = pb_grpc.RegistryStub(channel)
            fresh: dict[str, Endpoint] = {}
            in_snapshot = True
            async for event in stub.WatchEndpoints(pb.WatchEndpointsRequest()):
                kind = event.kind
                if kind == pb.EndpointEvent.KIND_SNAPSHOT:
                    fresh[event.endpoint.name] = event.endpoint
                elif kind == pb.EndpointEvent.KIND_SYNCED:
                    removed = set(table.endpoints) - set(fresh)
                    table.endpoints = fresh
                    in_snapshot = False
                    table.synced.set()
                    backoff = 0.05
                    if on_change is not None:
                        for ep in fresh.values():
                            on_change(ep, False)
                        for name in removed:
                            on_change(Endpoint(name=name), True)
                elif not in_snapshot:
                    deleted = kind == pb.EndpointEvent.KIND_DELETE
                    if deleted:
                        table.endpoints.pop(event.endpoint.name, None)
                    else:
                        table.endpoints[event.endpoint.name] = event.endpoint
                    if on_change is not None:
                        on_change(event.endpoint, deleted)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            log.warning("registry watch at %s broke (%s: %s); keeping %d routes, retrying",
                        registry_addr, exc.code().name, exc.details(), len(table.endpoints))
        finally:
            await channel.close()
        await asyncio.sleep(backoff * (1 + random.random() / 2))
        backoff = min(backoff * 2, max_backoff_s)
