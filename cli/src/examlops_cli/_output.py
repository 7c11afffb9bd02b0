"""Output for people (rich tables) or programs (`--json`), and one-line errors."""

from __future__ import annotations

import getpass
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import orjson
from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import state_name

from ._config import CliSettings

console = Console()
err_console = Console(stderr=True)


class Ctx:
    """Process-wide CLI state: output mode and settings."""

    json: bool = False
    _settings: CliSettings | None = None

    @classmethod
    def settings(cls) -> CliSettings:
        if cls._settings is None:
            cls._settings = CliSettings()
        return cls._settings

    @classmethod
    def actor(cls) -> str:
        return cls.settings().actor or os.environ.get("USER") or getpass.getuser()


def fail(message: str, code: int = 1) -> NoReturn:
    """One clear line on stderr, non-zero exit (also in --json mode, as {"error": ...})."""
    if Ctx.json:
        sys.stderr.write(orjson.dumps({"error": message}).decode() + "\n")
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


def emit_json(obj: Any) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")


def message_dict(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return out


def endpoint_dict(ep: reg.Endpoint) -> dict[str, Any]:
    d = message_dict(ep)
    d["state"] = state_name(ep.state)
    d["created_at_ms"], d["updated_at_ms"], d["revision"] = ep.created_at_ms, ep.updated_at_ms, ep.revision
    d["engine_block"] = orjson.loads(ep.engine_block_json) if ep.engine_block_json else None
    d.pop("engine_block_json", None)
    d["replicas"] = [replica_dict(r) for r in ep.replicas]
    return d


def replica_dict(r: reg.Replica) -> dict[str, Any]:
    """A replica with its state by name and its time as a number (MessageToDict gives enums and strings)."""
    return {"id": r.id, "base_url": r.base_url, "state": state_name(r.state), "source": r.source,
            "job_id": r.job_id, "draining": r.draining, "state_reason": r.state_reason,
            "last_health_ms": r.last_health_ms}


def replicas_ready(ep: reg.Endpoint) -> str:
    """`ready/total`: replicas READY and not draining, of all; empty for an endpoint with no server (echo)."""
    ready = sum(r.state == reg.ENDPOINT_STATE_READY and not r.draining for r in ep.replicas)
    return f"{ready}/{len(ep.replicas)}" if ep.replicas else ""


def pool_line(ep: reg.Endpoint) -> str:
    """`r0 READY http://a:8000, r1 STARTING http://b:8000 (draining)`: the pool on one line."""
    return ", ".join(f"{r.id} {state_name(r.state)} {r.base_url or '(no address)'}"
                     + (" (draining)" if r.draining else "") for r in ep.replicas)


STATE_STYLE = {"READY": "green", "FAILED": "red", "STOPPED": "dim", "DISABLED": "dim", "PENDING": "yellow",
               "STARTING": "yellow"}


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*[_cell(v) for v in row])
    console.print(t)


def _cell(v: Any) -> str:
    if isinstance(v, str) and v in STATE_STYLE:
        return f"[{STATE_STYLE[v]}]{v}[/]"
    return "" if v is None else str(v)
