"""`exa dev …`: helpers for working on a local stack."""

from __future__ import annotations

import typer

from ._output import Ctx, emit_json
from ._token import operator_token

app = typer.Typer(help="Local development helpers.", no_args_is_help=True)


@app.command()
def env() -> None:
    """Shell exports for the local stack: `eval "$(exa dev env)"`."""
    s = Ctx.settings()
    values = {
        "EXAMLOPS_GATEWAY_URL": s.gateway_url,
        "EXAMLOPS_ADMIN_KEY": s.admin_key.get_secret_value(),
        "OPENAI_BASE_URL": s.gateway_url.rstrip("/") + "/v1",
        "OPENAI_API_KEY": s.admin_key.get_secret_value(),
        "EXAMLOPS_REGISTRY_ADDR": s.registry_addr,
        "EXAMLOPS_LAUNCHER_ADDR": s.launcher_addr,
        "EXAMLOPS_ENGINE_PROXY_ADDR": s.engine_proxy_addr,
        "EXAMLOPS_MEDIAGUARD_ADDR": s.mediaguard_addr,
        "EXAMLOPS_OPERATOR_TOKEN": operator_token(),  # what the gRPC services authenticate exa and other tools by
    }
    if Ctx.json:
        emit_json(values)
        return
    for k, v in values.items():
        typer.echo(f"export {k}={v}")
