"""`exa gateway …`: the same models through the gateway (key, budget, cost).

`key` and `spend` use the gateway's admin API (the admin key, EXAMLOPS_ADMIN_KEY); `price` edits the
price table in the registry, which every gateway replica follows.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
import time
from typing import Annotated, Any

import httpx
import orjson
import typer

from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, console, emit_json, fail, table
from ._rpc import call

app = typer.Typer(help="The OpenAI-compatible gateway in front of every endpoint.", no_args_is_help=True)
key_app = typer.Typer(help="Virtual keys: allowed models, budget, rate limits, expiry.", no_args_is_help=True)
price_app = typer.Typer(help="Prices per model (USD per million tokens), kept in the registry.",
                        no_args_is_help=True)
app.add_typer(key_app, name="key")
app.add_typer(price_app, name="price")


def gateway_send(method: str, path: str, key: str | None = None, **kwargs: object) -> httpx.Response:
    """One call to the gateway with the admin key (or `key`); raises httpx.HTTPError when unreachable."""
    s = Ctx.settings()
    headers = {"Authorization": f"Bearer {key or s.admin_key.get_secret_value()}",
               "X-Examlops-Actor": Ctx.actor()}
    return httpx.request(method, s.gateway_url.rstrip("/") + path, headers=headers,
                         timeout=600, **kwargs)  # type: ignore[arg-type]


def unreachable_line(exc: httpx.HTTPError) -> str:
    return (f"cannot reach the gateway at {Ctx.settings().gateway_url} ({type(exc).__name__}); "
            "is the stack up? `make up`, or set EXAMLOPS_GATEWAY_URL")


def gateway_request(method: str, path: str, key: str | None = None, **kwargs: object) -> httpx.Response:
    try:
        return gateway_send(method, path, key, **kwargs)
    except httpx.HTTPError as exc:
        fail(unreachable_line(exc))


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


# --- virtual keys -------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_expiry(text: str) -> int:
    """`30d`, `12h`, `90m`, or an ISO date/time (UTC unless it says otherwise) → unix seconds."""
    m = _DURATION.match(text.strip())
    if m:
        return int(time.time()) + int(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        fail(f"--expires {text!r}: give a duration like 30d, 12h, 90m, or a date like 2026-12-31")
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def admin_json(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    resp = gateway_request(method, path, content=orjson.dumps(body) if body is not None else None)
    if resp.status_code >= 400:
        fail(error_line(resp))
    return resp.json()


def _usd(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}".rstrip("0").rstrip(".") if v else "0"


def _key_rows(rows: list[dict[str, Any]]) -> None:
    table("Virtual keys", ["id", "tenant", "project", "models", "budget USD", "spend USD", "remaining USD",
                           "requests", "rpm", "tpm", "expires", "state"], [
        [r["id"], r["tenant"], r["project"], ",".join(r["models"]), _usd(r["budget"]), _usd(r["spend"]),
         _usd(r["remaining"]), r["requests"], r["rpm"] or "-", r["tpm"] or "-",
         dt.datetime.fromtimestamp(r["expires_at"], dt.UTC).strftime("%Y-%m-%d %H:%M") if r["expires_at"] else "-",
         r["state"]] for r in rows])


@key_app.command("issue")
def key_issue(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to.")],
    project: Annotated[str, typer.Option(help="Project its spend is attributed to.")],
    model: Annotated[list[str], typer.Option("--model", help="Allowed model (route); repeat for more.")],
    budget: Annotated[float | None, typer.Option(help="Budget in USD; none: unbudgeted.", min=0)] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.", min=1)] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.", min=1)] = None,
    expires: Annotated[str, typer.Option(help="30d, 12h, 90m or an ISO date; default: never.")] = "",
    guardrail: Annotated[list[str] | None, typer.Option(
        "--guardrail", help="Guardrail policy applied to every call of the key; repeat for more.")] = None,
) -> None:
    """Issue a virtual key. The key is shown once: it is stored only as a hash."""
    body: dict[str, Any] = {"tenant": tenant, "project": project, "models": model, "guardrails": guardrail or []}
    for name, value in (("budget_usd", budget), ("rpm", rpm), ("tpm", tpm)):
        if value is not None:
            body[name] = value
    if expires:
        body["expires_at"] = parse_expiry(expires)
    row = admin_json("POST", "/admin/keys", body)
    if Ctx.json:
        emit_json(row)
        return
    _key_rows([row])
    console.print(f"virtual key (shown once, store it now): [bold]{row['virtual_key']}[/]", highlight=False)


@key_app.command("list")
def key_list(
    all_: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
) -> None:
    """Keys with their spend, budget, remaining budget and requests."""
    rows = admin_json("GET", f"/admin/keys?include_revoked={'true' if all_ else 'false'}")["data"]
    if Ctx.json:
        emit_json(rows)
        return
    _key_rows(rows)


@key_app.command("update")
def key_update(
    key_id: Annotated[str, typer.Argument(help="Key id (from `exa gateway key list`).")],
    budget: Annotated[float | None, typer.Option(help="New budget in USD.", min=0)] = None,
    no_budget: Annotated[bool, typer.Option("--no-budget", help="Remove the budget.")] = False,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute; 0 removes the limit.", min=0)] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute; 0 removes the limit.", min=0)] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Replace the allowed models.")] = None,
    expires: Annotated[str, typer.Option(help="New expiry: 30d, 12h, or an ISO date.")] = "",
    guardrail: Annotated[list[str] | None, typer.Option(
        "--guardrail", help="Replace the key's guardrail policies.")] = None,
    no_guardrails: Annotated[bool, typer.Option("--no-guardrails", help="Remove its guardrail policies.")] = False,
) -> None:
    """Change a key's budget, limits, models, guardrails or expiry (audited as key.update)."""
    body: dict[str, Any] = {}
    if guardrail or no_guardrails:
        body["guardrails"] = [] if no_guardrails else guardrail
    if budget is not None or no_budget:
        body["budget_usd"] = None if no_budget else budget
    if rpm is not None:
        body["rpm"] = rpm or None
    if tpm is not None:
        body["tpm"] = tpm or None
    if model:
        body["models"] = model
    if expires:
        body["expires_at"] = parse_expiry(expires)
    if not body:
        fail("nothing to change: give --budget, --no-budget, --rpm, --tpm, --model, --guardrail or --expires")
    row = admin_json("PATCH", f"/admin/keys/{key_id}", body)
    if Ctx.json:
        emit_json(row)
        return
    _key_rows([row])


@key_app.command("revoke")
def key_revoke(key_id: Annotated[str, typer.Argument(help="Key id (from `exa gateway key list`).")]) -> None:
    """Revoke a key at once on every replica (its record and spend stay)."""
    row = admin_json("POST", f"/admin/keys/{key_id}/revoke")
    if Ctx.json:
        emit_json(row)
        return
    console.print(f"key {row['id']} revoked", highlight=False)


# --- prices -------------------------------------------------------------------------------------


def _micro(usd: float) -> int:
    return round(usd * 1_000_000)


@price_app.command("set")
def price_set(
    model: Annotated[str, typer.Argument(help="Model (route name) as clients send it.")],
    input_per_mtok: Annotated[float | None, typer.Option(help="USD per million prompt tokens.", min=0)] = None,
    output_per_mtok: Annotated[float | None, typer.Option(help="USD per million completion tokens.", min=0)] = None,
    gpu_hour: Annotated[float | None, typer.Option(
        help="USD per GPU-hour (EXAMLOPS_LLM_COST_PROVIDER=gpu-hour).", min=0)] = None,
    gpus: Annotated[int, typer.Option(
        help="GPUs of one server (0: the endpoint's engine block, tensor x pipeline parallel size).", min=0)] = 0,
    min_tokens_per_s: Annotated[float, typer.Option(
        help="With --gpu-hour: the slowest token throughput a call is billed at (bounds a budget's "
             "reservation).", min=0)] = 0.0,
) -> None:
    """Set a model's price: per token, per GPU-hour, or both (replaces the whole entry; every gateway
    replica follows the price table's watch: at once). Which one bills is the gateway's
    EXAMLOPS_LLM_COST_PROVIDER."""
    if (input_per_mtok is None) != (output_per_mtok is None):
        fail("give both --input-per-mtok and --output-per-mtok (a per-token price), or neither")
    if input_per_mtok is None and gpu_hour is None:
        fail("give a per-token price (--input-per-mtok, --output-per-mtok), a GPU-hour price (--gpu-hour, "
             "--min-tokens-per-s), or both")
    if gpu_hour is not None and gpu_hour > 0 and min_tokens_per_s <= 0:
        fail("--gpu-hour needs --min-tokens-per-s: the slowest throughput a call is billed at, which bounds "
             "what a budget reserves (a call is never charged more than its tokens at that speed)")
    price = call("registry", "SetPrice", reg.SetPriceRequest(price=reg.Price(
        model=model, input_micro_usd_per_mtok=_micro(input_per_mtok or 0),
        output_micro_usd_per_mtok=_micro(output_per_mtok or 0), gpu_hour_micro_usd=_micro(gpu_hour or 0),
        gpus=gpus, min_tokens_per_s=min_tokens_per_s), actor=Ctx.actor()))
    _prices([price])


@price_app.command("list")
def price_list() -> None:
    """Prices per model. A model without one is refused for keys with a budget."""
    _prices(list(call("registry", "ListPrices", reg.ListPricesRequest()).prices))


def _prices(prices: list[reg.Price]) -> None:
    rows = [{"model": p.model, "input_per_mtok": p.input_micro_usd_per_mtok / 1e6,
             "output_per_mtok": p.output_micro_usd_per_mtok / 1e6, "gpu_hour": p.gpu_hour_micro_usd / 1e6,
             "gpus": p.gpus, "min_tokens_per_s": p.min_tokens_per_s, "updated_by": p.updated_by,
             "updated_at_ms": p.updated_at_ms} for p in prices]
    if Ctx.json:
        emit_json(rows)
        return
    table("Prices (USD per million tokens; per GPU-hour)",
          ["model", "input", "output", "GPU-hour", "GPUs", "min tok/s", "updated by"],
          [[p.model, _usd(p.input_micro_usd_per_mtok / 1e6), _usd(p.output_micro_usd_per_mtok / 1e6),
            _usd(p.gpu_hour_micro_usd / 1e6) if p.gpu_hour_micro_usd else "-",
            (str(p.gpus) if p.gpus else "engine") if p.gpu_hour_micro_usd else "-",
            f"{p.min_tokens_per_s:g}" if p.gpu_hour_micro_usd else "-", p.updated_by] for p in prices])


# --- spend --------------------------------------------------------------------------------------


@app.command()
def spend(
    by: Annotated[str, typer.Option(help="Group by key, project, model, tenant or provider (the cost "
                                         "provider that priced each call).")] = "key",
    since: Annotated[str, typer.Option(help="Only calls in the last 24h, 7d, ... (default: all kept).")] = "",
) -> None:
    """Requests, tokens and cost summed from the per-call cost records."""
    since_s = 0
    if since:
        m = _DURATION.match(since.strip())
        if not m:
            fail(f"--since {since!r}: give a duration like 24h or 7d")
        since_s = int(time.time()) - int(m.group(1)) * _UNIT_S[m.group(2)]
    rows = admin_json("GET", f"/admin/spend?group_by={by}&since={since_s}")["data"]
    if Ctx.json:
        emit_json(rows)
        return
    clamped = any(r.get("clamped_micro_usd") for r in rows)  # a custom provider asked more than was reserved
    table(f"Spend by {by}", [by, "requests", "errors", "prompt tokens", "completion tokens", "cost USD",
                             *(["clamped USD"] if clamped else [])], [
        [r[by] or "-", r["requests"], r["errors"], r["prompt_tokens"], r["completion_tokens"], _usd(r["cost"]),
         *([_usd(r.get("clamped_micro_usd", 0) / 1e6)] if clamped else [])]
        for r in rows])
