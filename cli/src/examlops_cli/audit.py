"""`exa audit list`: the append-only audit trail."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import typer

from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, emit_json, message_dict, table
from ._rpc import call

app = typer.Typer(help="Who changed what, and when.", no_args_is_help=True)


@app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="Newest N events.")] = 50,
    target: Annotated[str, typer.Option(help="Only this target, e.g. endpoint:smol.")] = "",
    action: Annotated[str, typer.Option(help="Only this action, e.g. register, stop.")] = "",
) -> None:
    """Audit events, newest first."""
    resp = call("registry", "ListAuditEvents", reg.ListAuditEventsRequest(limit=limit, target=target, action=action))
    if Ctx.json:
        emit_json([message_dict(e) | {"time_ms": e.time_ms} for e in resp.events])
        return
    table("Audit events", ["time", "actor", "action", "target"], [
        [dt.datetime.fromtimestamp(e.time_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), e.actor, e.action, e.target]
        for e in resp.events])
