"""The gateway's entries in the registry's audit trail: operator changes (written before the change)
and guarded calls (a guardrail block, recorded off the request path)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
import orjson
from starlette.requests import Request

from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc

from .._state import GatewayState
from ..governance import Ticket, now_ms
from ._errors import OpenAIError

log = logging.getLogger(__name__)


async def audit(state: GatewayState, request: Request, action: str, target: str,
                before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
    """The registry's audit event for a change, written before the change (503 when it cannot be)."""
    actor = request.headers.get("x-examlops-actor") or "admin"
    event = reg.AuditEvent(actor=actor, action=action, target=target,
                           before_json=orjson.dumps(before).decode() if before else "",
                           after_json=orjson.dumps(after).decode() if after else "", time_ms=now_ms())
    try:
        await state.registry.RecordAuditEvent(reg.RecordAuditEventRequest(event=event), timeout=5)
    except grpc.aio.AioRpcError as exc:
        raise OpenAIError(503, f"the audit trail (registry) is unavailable ({exc.code().name}); nothing changed",
                          type="service_unavailable", code="audit_unavailable") from None


def block_auditor(registry: reg_grpc.RegistryStub, background: set[asyncio.Task[None]]
                  ) -> Callable[[Ticket, str, str, str, str], None]:
    """guardrail.block on key:<id> for every blocked call: the model, policy, detector, entity and
    direction, never the matched text. Sent in the background: the client's answer does not wait."""

    async def send(event: reg.AuditEvent) -> None:
        try:
            await registry.RecordAuditEvent(reg.RecordAuditEventRequest(event=event), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("cannot record a guardrail block in the audit trail: %s", exc.code().name)

    def record(ticket: Ticket, policy: str, detector: str, entity: str, direction: str) -> None:
        what: dict[str, Any] = {"model": ticket.model, "policy": policy, "detector": detector, "entity": entity,
                                "direction": direction}
        event = reg.AuditEvent(actor="gateway", action="guardrail.block", target=f"key:{ticket.caller.key_id}",
                               after_json=orjson.dumps(what).decode(), time_ms=now_ms())
        task = asyncio.get_running_loop().create_task(send(event))
        background.add(task)
        task.add_done_callback(background.discard)

    return record
