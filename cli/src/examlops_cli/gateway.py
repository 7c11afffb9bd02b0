"""`exa gateway …`: the same models through the gateway (key, budget, cost)."""

from __future__ import annotations

import sys
from typing import Annotated

import httpx
import orjson
import typer

from ._output import Ctx, console, emit_json, fail

app = typer.Typer(help="The OpenAI-compatible gateway in front of every endpoint.", no_args_is_help=True)


def gateway_request(method: str, path: str, key: str | None = None, **kwargs: object) -> httpx.Response:
    s = Ctx.settings()
    headers = {"Authorization": f"Bearer {key or s.admin_key.get_secret_value()}"}
    try:
        return httpx.request(method, s.gateway_url.rstrip("/") + path, headers=headers,
                             timeout=600, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        fail(f"cannot reach the gateway at {s.gateway_url} ({type(exc).__name__}); "
             "is the stack up? `make up`, or set EXAMLOPS_GATEWAY_URL")


def error_line(resp: httpx.Response) -> str:
    try:
        err = resp.json()["error"]
        code = f" [{err['code']}]" if err.get("code") else ""
        return f"{resp.status_code} {err.get('type')}{code}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code}: {resp.text[:300]}"


@app.command()
def chat(
    model: Annotated[str, typer.Argument(help="Route (endpoint name).")],
    message: Annotated[str, typer.Option("--message", "-m", help="The user message.")],
    key: Annotated[str, typer.Option(help="Virtual key; default: the admin key (EXAMLOPS_ADMIN_KEY).")] = "",
    max_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.")] = 256,
) -> None:
    """Chat with a model through the gateway (text only; use `exa serve llm chat --image` for images)."""
    body = {"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens}
    resp = gateway_request("POST", "/v1/chat/completions", key or None, content=orjson.dumps(body),
                           )
    if resp.status_code != 200:
        fail(error_line(resp))
    obj = resp.json()
    if Ctx.json:
        emit_json(obj)
        return
    content = obj["choices"][0]["message"].get("content") or ""
    console.print(content, highlight=False)
    usage = obj.get("usage") or {}
    if usage:
        sys.stderr.write(f"[{usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} "
                         "completion tokens]\n")
