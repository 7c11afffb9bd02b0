"""Discovery, probes and the state each replica should be in; the registry derives the endpoint's.

Each replica is checked on its own (its job's endpoint file, its probe, its substrate view), all
at once, so one dead server's timeout does not delay the others; then what changed is recorded
per replica (UpdateEndpoint with `replica`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import error_reason, state_name

from ._adapters import HpcAdapter, SubstrateView, replicas_of
from ._probe import probe
from ._registry_ops import RPC_TIMEOUT_S, RegistryOps

#: A probe that changes nothing is recorded (last_health_ms) at most this often, not on every call.
HEALTH_REFRESH_MS = 15_000
#: Substrates whose job or container state explains a server that does not answer.
WATCHED = ("slurm", "flux", "compose")
QUIET = (reg.ENDPOINT_STATE_STOPPED, reg.ENDPOINT_STATE_DISABLED)


def replica_view(ep: reg.Endpoint, replica: reg.Replica) -> reg.Endpoint:
    """The endpoint as one replica sees it: its address, job and state in the endpoint's fields."""
    out = reg.Endpoint()
    out.CopyFrom(ep)
    del out.replicas[:]
    out.base_url, out.job_id = replica.base_url, replica.job_id
    out.state, out.state_reason = replica.state, replica.state_reason
    return out


def replica_key(ep: reg.Endpoint, replica: reg.Replica) -> dict[str, str]:
    """UpdateEndpoint's `replica` for a probe's result. A pool of one is updated as the endpoint (its
    only replica follows), so the endpoint's state_reason stays the server's, as before pools."""
    return {"replica": replica.id} if len(ep.replicas) > 1 else {}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class ReplicaCheck:
    """One replica after its probe: what it is, what it should be and why."""

    replica: reg.Replica
    ready: bool
    detail: str                      # why it is in `target`
    target: int                      # the state it should be in
    view: SubstrateView | None
    discovered: str = ""             # an address its job published that is not on record yet


class Reconciler(RegistryOps):
    def _judge(self, ep: reg.Endpoint, replica_id: str, view: SubstrateView | None, ready: bool,
               detail: str) -> tuple[int, str]:
        """The state a replica (`ep` is its replica_view) should be in after a probe, and why."""
        if ready:
            return reg.ENDPOINT_STATE_READY, detail
        adapter = self._adapter(ep)
        if adapter.name == "kserve":
            return ep.state, "never applied by the launcher; apply the manifest with kubectl and register its URL"
        hpc = adapter if isinstance(adapter, HpcAdapter) else None
        if view is not None and view.alive is False:
            if hpc is not None and not ep.base_url:
                hint = " within its walltime" if view.state == "TIMEOUT" else ""
                return reg.ENDPOINT_STATE_FAILED, (
                    f"{view.detail}: it ended without publishing its address in "
                    f"{hpc.endpoint_file(ep.name, replica_id)}{hint}; see {hpc.log_path(ep.name)}")
            return reg.ENDPOINT_STATE_FAILED, f"{view.detail}; {detail}"
        if view is not None and view.alive and ep.state in (reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING):
            if not ep.base_url and hpc is not None:
                return reg.ENDPOINT_STATE_PENDING, (
                    f"{view.detail}; waiting for it to publish {hpc.endpoint_file(ep.name, replica_id)}")
            return reg.ENDPOINT_STATE_STARTING, f"{view.detail}; server not answering yet ({detail})"
        if view is not None and view.alive is None and view.detail and not ep.base_url:
            return ep.state, view.detail
        if not ep.base_url and ep.state in (reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING):
            return ep.state, detail
        return reg.ENDPOINT_STATE_FAILED, detail

    @staticmethod
    def _adopt(rep: reg.Endpoint, view: SubstrateView | None) -> bool:
        """Take an address the substrate reports (an endpoint file, a container's port) when it is new."""
        if view is None or not view.base_url or view.base_url == rep.base_url:
            return False
        rep.base_url, rep.state = view.base_url, reg.ENDPOINT_STATE_STARTING
        return True

    async def _check(self, ep: reg.Endpoint, replica: reg.Replica) -> ReplicaCheck:
        """Discover, probe and judge one replica; records nothing."""
        adapter = self._adapter(ep)
        rep = replica_view(ep, replica)
        view = await adapter.status(ep, replica) if isinstance(adapter, HpcAdapter) and not rep.base_url else None
        discovered = rep.base_url if self._adopt(rep, view) else ""
        ready, detail = await probe(self.http, rep, self.settings.probe_timeout_s)
        if not ready and view is None and ep.launcher in WATCHED and rep.state in (
                reg.ENDPOINT_STATE_PENDING, reg.ENDPOINT_STATE_STARTING, reg.ENDPOINT_STATE_READY):
            view = await adapter.status(ep, replica)
            if self._adopt(rep, view):
                discovered = rep.base_url
                ready, detail = await probe(self.http, rep, self.settings.probe_timeout_s)
        target, why = self._judge(rep, replica.id, view, ready, detail)
        return ReplicaCheck(replica, ready, why, target, view, discovered)

    async def _update_probed(self, context: grpc.aio.ServicerContext, ep: reg.Endpoint, actor: str, action: str,
                             **fields: Any) -> reg.Endpoint:
        """Record a probe's result, unless its replica was removed meanwhile (a drain ended): then nothing."""
        try:
            updated: reg.Endpoint = await self.registry.UpdateEndpoint(reg.UpdateEndpointRequest(
                name=ep.name, actor=actor or "launcher", action=action, **fields), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if error_reason(exc)[0] == "replica_not_found":
                return ep
            await self._registry_refused(context, exc)
        return updated

    async def _record_check(self, ep: reg.Endpoint, check: ReplicaCheck, actor: str,
                            context: grpc.aio.ServicerContext) -> reg.Endpoint:
        """Write what a check found: a discovered address, then the state when it changed."""
        r, key = check.replica, replica_key(ep, check.replica)
        state, reason = r.state, r.state_reason
        if check.discovered:
            state = reg.ENDPOINT_STATE_STARTING
            reason = f"job {r.job_id} published {check.discovered}" if r.job_id else f"found at {check.discovered}"
            ep = await self._update_probed(context, ep, actor, "discover", base_url=check.discovered,
                                           state=state, state_reason=reason, **key)
            await self._record_job(ep, r.job_id, actor, check.view.state if check.view else "", check.discovered)
        if check.view is not None and check.view.state:
            await self._record_job(ep, r.job_id, actor, check.view.state)
        stamp = now_ms()
        pooled = bool(ep.replicas)     # a record with no replica at all (an addressless engine) has no stamp
        stale = pooled and stamp - r.last_health_ms > HEALTH_REFRESH_MS
        if check.target != state or check.detail != reason or stale:
            fields: dict[str, Any] = {"state": check.target, "state_reason": check.detail, **key}
            if pooled:
                fields["last_health_ms"] = stamp
            ep = await self._update_probed(context, ep, actor, "health", **fields)
        return ep

    async def _reconcile(self, ep: reg.Endpoint, actor: str, context: grpc.aio.ServicerContext
                         ) -> tuple[reg.Endpoint, bool, str, list[ReplicaCheck]]:
        """Check every replica at once, then record; ready when any replica is."""
        if ep.state in QUIET:
            return ep, False, f"endpoint is {state_name(ep.state)}", []
        pool = [r for r in replicas_of(ep) if r.state not in QUIET]
        checks = list(await asyncio.gather(*(self._check(ep, r) for r in pool)))
        for check in checks:
            ep = await self._record_check(ep, check, actor, context)
        detail = pool_detail(checks)
        if len(ep.replicas) > 1 and ep.state_reason != detail:
            ep = await self._update(context, ep.name, actor, "health", state_reason=detail)
        return ep, any(c.ready for c in checks), detail, checks


def pool_detail(checks: list[ReplicaCheck]) -> str:
    """One replica: its own detail, as before pools; several: each replica's state and why."""
    if not checks:
        return "no replica to probe"
    if len(checks) == 1:
        return checks[0].detail
    ready = sum(c.ready for c in checks)
    return f"{ready}/{len(checks)} replicas ready; " + "; ".join(
        f"{c.replica.id} {state_name(c.target)}: {c.detail}" for c in checks)
