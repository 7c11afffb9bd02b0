"""An endpoint's pool of replicas: checking the replicas of a registration, and the endpoint fields
derived from them after every mutation.

One rule, `settle`, keeps `Endpoint.base_url`, `job_id` and `state` in step with the pool, so that
code written for one server per endpoint keeps working by reading the endpoint's own fields.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import grpc

from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import replica_routable, state_name

from ._checks import Refused, few

REPLICA_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,30}$")
#: States an operator sets on an endpoint; the replicas' states never override them.
OPERATOR_STATES = (pb.ENDPOINT_STATE_STOPPED, pb.ENDPOINT_STATE_DISABLED)
#: A pool is as good as its best replica.
STATE_RANK = {pb.ENDPOINT_STATE_READY: 4, pb.ENDPOINT_STATE_STARTING: 3, pb.ENDPOINT_STATE_PENDING: 2,
              pb.ENDPOINT_STATE_FAILED: 1}


class InvalidEndpoint(Refused):
    """A registration or a change the registry refuses as malformed; `field` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, "invalid_endpoint", message, field)


def checked_base_url(url: str, field: str) -> str:
    """`url` without its trailing slash; InvalidEndpoint(field) unless it is a server address by the
    engine block's own rule (http(s)://host[:port][/path]; no credentials: the key is a secret ref)."""
    if not url:
        return url
    from examlops.engine import EngineBlockError, server_url

    try:
        return server_url(url, "use api_key_secret_ref")
    except EngineBlockError as exc:
        (issue,) = exc.issues
        raise InvalidEndpoint(field, f"{field} {issue.value!r} {issue.message} "
                                     f"(accepted: {', '.join(issue.accepted)})") from None


def checked_replica_id(rid: str, field: str) -> str:
    if rid and not REPLICA_ID_RE.match(rid):
        raise InvalidEndpoint(field, f"invalid replica id {rid!r}: use 1-31 characters of a-z, 0-9, '.', '_' "
                                     "or '-', starting with a letter or digit (or leave it empty: r0, r1, ...)")
    return rid


def replica_source(launcher: str, job_id: str) -> str:
    """Where a replica runs when its launcher did not say: external, or <launcher>:<job>."""
    if launcher == "external" or not job_id:
        return launcher or "external"
    return f"{launcher}:{job_id}"


def next_replica_id(taken: Iterable[str]) -> str:
    """The first r<N> not in `taken`."""
    used = set(taken)
    n = 0
    while f"r{n}" in used:
        n += 1
    return f"r{n}"


def find_replica(ep: pb.Endpoint, rid: str) -> pb.Replica | None:
    return next((r for r in ep.replicas if r.id == rid), None)


def fill_replica(ep: pb.Endpoint, replica: pb.Replica, field: str, default_state: pb.EndpointState) -> None:
    """Check `replica` (as a member of `ep`'s pool, which it is not yet part of) and fill its defaults.

    InvalidEndpoint(f"{field}.id"/f"{field}.base_url") for a malformed id or address; the caller
    decides what a duplicate means (see `duplicate_of`)."""
    checked_replica_id(replica.id, f"{field}.id")
    replica.base_url = checked_base_url(replica.base_url, f"{field}.base_url")
    if replica.state == pb.ENDPOINT_STATE_UNSPECIFIED:
        replica.state = default_state
    replica.source = replica.source or replica_source(ep.launcher, replica.job_id)


def duplicate_of(pool: Iterable[pb.Replica], replica: pb.Replica) -> str | None:
    """The field ("id" or "base_url") `replica` repeats from another member of `pool`, if any."""
    for other in pool:
        if other is replica:
            continue
        if replica.id and other.id == replica.id:
            return "id"
        if replica.base_url and other.base_url == replica.base_url:
            return "base_url"
    return None


def normalise_replicas(ep: pb.Endpoint) -> None:
    """Check the replicas of a registration (in place) and derive the endpoint's fields.

    No replicas but an address or a job: one replica r0 made from them (the single-server form).
    """
    for i, replica in enumerate(ep.replicas):
        field = f"replicas[{i}]"
        fill_replica(ep, replica, field, ep.state)
        if (dup := duplicate_of(ep.replicas[:i], replica)) is not None:
            raise InvalidEndpoint(f"{field}.{dup}", f"{field}.{dup} {getattr(replica, dup)!r} is given twice; "
                                                    "each replica needs its own id and address")
    for replica in ep.replicas:
        if not replica.id:
            replica.id = next_replica_id(r.id for r in ep.replicas)
    settle(ep)


def settle(ep: pb.Endpoint) -> None:
    """Derive the endpoint's base_url, job_id and state from its pool (in place); after every mutation.

    A record with no replicas but an address or a job (a registration in the single-server form, or a
    record stored before pools existed) first gets its replica r0. base_url/job_id are the first
    routable replica's (else the first replica's); the state is the best replica's, unless an
    operator stopped or disabled the endpoint.
    """
    if not ep.replicas:
        if not (ep.base_url or ep.job_id):
            return
        ep.replicas.add(id="r0", base_url=ep.base_url, job_id=ep.job_id, state=ep.state,
                        state_reason=ep.state_reason, source=replica_source(ep.launcher, ep.job_id))
    first = next((r for r in ep.replicas if replica_routable(r)), ep.replicas[0])
    ep.base_url, ep.job_id = first.base_url, first.job_id
    if ep.state in OPERATOR_STATES:
        return
    ranked = [r.state for r in ep.replicas if r.state in STATE_RANK]
    if ranked:
        ep.state = max(ranked, key=STATE_RANK.__getitem__)


def _replica_named(ep: pb.Endpoint, rid: str) -> pb.Replica:
    replica = find_replica(ep, rid)
    if replica is None:
        raise Refused(grpc.StatusCode.NOT_FOUND, "replica_not_found",
                      f"endpoint {ep.name!r} has no replica {rid!r}; its replicas: {few(r.id for r in ep.replicas)}",
                      "replica")
    return replica


def _refuse_duplicate(ep: pb.Endpoint, replica: pb.Replica, field: str) -> None:
    dup = duplicate_of(ep.replicas, replica)
    if dup is not None:
        value = getattr(replica, dup)
        other = next(r.id for r in ep.replicas if r is not replica and getattr(r, dup) == value)
        raise Refused(grpc.StatusCode.ALREADY_EXISTS, "replica_exists",
                      f"endpoint {ep.name!r} already has replica {other!r} with {dup} {value!r}", f"{field}.{dup}")


#: UpdateEndpoint fields that change one server, so need a replica on a pool of several.
REPLICA_FIELDS = ("base_url", "job_id", "draining", "last_health_ms")


def apply_update(ep: pb.Endpoint, req: pb.UpdateEndpointRequest) -> None:
    """UpdateEndpoint's fields onto `ep` (in place, settled after); Refused names what is wrong.

    With `replica`, the fields change that replica. Without it, STOPPED and DISABLED (and a live
    state that leaves them) are the endpoint's own, STOPPED stopping every replica too; the other
    fields change the only replica of a pool of one (so single-server callers keep working), and a
    pool of several needs a replica for them (state_reason is then the endpoint's).
    """
    settle(ep)
    url = checked_base_url(req.base_url, "base_url") if req.HasField("base_url") else None
    if req.replica:
        state = req.state if req.HasField("state") else None
        _update_replica(ep, _replica_named(ep, req.replica), req, url, state)
    elif not ep.replicas:
        if req.HasField("draining") or req.HasField("last_health_ms"):
            raise InvalidEndpoint("replica", f"endpoint {ep.name!r} has no replica: draining and "
                                             "last_health_ms apply to a replica")
        if req.HasField("state"):
            ep.state = req.state
        if url is not None:
            ep.base_url = url
        if req.HasField("job_id"):
            ep.job_id = req.job_id
        if req.HasField("state_reason"):
            ep.state_reason = req.state_reason
    else:
        only = ep.replicas[0] if len(ep.replicas) == 1 else None
        if only is None:
            changed = [f for f in REPLICA_FIELDS if req.HasField(f)]
            if changed:
                raise InvalidEndpoint("replica", f"endpoint {ep.name!r} has {len(ep.replicas)} replicas "
                                                 f"({few(r.id for r in ep.replicas)}): name the replica whose "
                                                 f"{', '.join(changed)} changes")
        if req.HasField("state"):
            _set_endpoint_state(ep, req.state, only)
        if req.HasField("state_reason"):
            ep.state_reason = req.state_reason
        if only is not None:
            _update_replica(ep, only, req, url, None)
    settle(ep)


def _set_endpoint_state(ep: pb.Endpoint, state: pb.EndpointState, only: pb.Replica | None) -> None:
    """A state given without a replica: STOPPED and DISABLED are the operator's, on the endpoint."""
    if state == pb.ENDPOINT_STATE_STOPPED:
        for r in ep.replicas:
            r.state = state
        ep.state = state
    elif state == pb.ENDPOINT_STATE_DISABLED:
        ep.state = state
    else:
        # A live state: it leaves STOPPED or DISABLED; stopped replicas (all of them, after a stop)
        # come back with it, and the only replica of a pool of one takes it whatever its state.
        ep.state = state
        for r in ep.replicas:
            if r is only or r.state == pb.ENDPOINT_STATE_STOPPED:
                r.state = state


def _update_replica(ep: pb.Endpoint, replica: pb.Replica, req: pb.UpdateEndpointRequest, url: str | None,
                    state: pb.EndpointState | None) -> None:
    if state is not None:
        replica.state = state
    if url is not None:
        replica.base_url = url
        _refuse_duplicate(ep, replica, "replica")
    if req.HasField("job_id"):
        if replica.source == replica_source(ep.launcher, replica.job_id):  # derived, so follows the job
            replica.source = replica_source(ep.launcher, req.job_id)
        replica.job_id = req.job_id
    if req.HasField("state_reason"):
        replica.state_reason = req.state_reason
    if req.HasField("draining"):
        replica.draining = req.draining
    if req.HasField("last_health_ms"):
        replica.last_health_ms = req.last_health_ms


def add_replica(ep: pb.Endpoint, given: pb.Replica) -> pb.Replica:
    """Add a copy of `given` to `ep`'s pool (in place, settled after) and return it as added."""
    settle(ep)
    replica = pb.Replica()
    replica.CopyFrom(given)
    if not (replica.base_url or replica.job_id):
        raise InvalidEndpoint("replica.base_url", "a replica needs a base_url (or the job_id of the job "
                                                  "that will publish one)")
    fill_replica(ep, replica, "replica",
                 pb.ENDPOINT_STATE_STARTING if replica.base_url else pb.ENDPOINT_STATE_PENDING)
    _refuse_duplicate(ep, replica, "replica")
    replica.id = replica.id or next_replica_id(r.id for r in ep.replicas)
    ep.replicas.append(replica)
    settle(ep)
    return replica


def remove_replica(ep: pb.Endpoint, rid: str) -> None:
    """Forget replica `rid` of `ep` (in place, settled after); the last one stays."""
    settle(ep)
    if not rid:
        raise InvalidEndpoint("replica", "name the replica to remove (exa serve llm status lists them)")
    replica = _replica_named(ep, rid)
    if len(ep.replicas) == 1:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "last_replica",
                      f"{rid!r} is the last replica of endpoint {ep.name!r} "
                      f"(state {state_name(ep.state)}); stop the endpoint instead: exa serve llm stop {ep.name}",
                      "replica")
    ep.replicas.remove(replica)
    settle(ep)
