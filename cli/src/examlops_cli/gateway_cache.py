"""`exa gateway cache …`: response-cache policies per endpoint (and per key), their stats, and flushing
stored answers. See services/gateway/CACHE.md."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ._output import Ctx, console, emit_json, table
from .gateway import admin_json

app = typer.Typer(help="The response cache: exact or semantic, shared by every gateway replica, per endpoint and "
                       "optionally per key.", no_args_is_help=True)

_MODEL = Annotated[str, typer.Option("--model", help="Endpoint (route name).")]
_KEY = Annotated[str, typer.Option("--key", help="Key id: a policy for this key only (it wins over the endpoint's).")]


def _show(rows: list[dict[str, Any]]) -> None:
    if Ctx.json:
        emit_json(rows)
        return
    table("Cache policies", ["model", "key", "mode", "scope", "ttl s", "sampled", "embedding model", "threshold"], [
        [r["model"], r.get("key_id") or "-", r["mode"], r["scope"], r["ttl_s"], "yes" if r["sampled"] else "no",
         r.get("embedding_model", "-"), r.get("threshold", "-")] for r in rows])


@app.command("set")
def cache_set(
    model: _MODEL,
    mode: Annotated[str, typer.Option("--mode", help="exact, semantic, or off (removes the policy).")],
    embedding_model: Annotated[str | None, typer.Option(
        "--embedding-model", help="Embedding route of a semantic policy (default: minilm).")] = None,
    threshold: Annotated[float | None, typer.Option(
        "--threshold", help="Cosine similarity a semantic hit needs, in (0, 1] (default 0.95).")] = None,
    ttl: Annotated[int | None, typer.Option("--ttl", help="Seconds an answer is kept (default 600).")] = None,
    scope: Annotated[str | None, typer.Option(
        "--scope", help="Who shares answers: key (default), project or tenant.")] = None,
    sampled: Annotated[bool, typer.Option(
        "--sampled", help="Also cache requests that sample (temperature > 0 without a seed).")] = False,
    key: _KEY = "",
) -> None:
    """Set an endpoint's cache policy, or a key's on it (audited as cache.set); every gateway replica applies
    it within a second.

    Example: `exa gateway cache set --model smol --mode semantic --threshold 0.92 --ttl 3600 --scope project`.
    """
    body: dict[str, Any] = {"model": model, "mode": mode, "sampled": sampled}
    given = {"embedding_model": embedding_model, "threshold": threshold, "ttl_s": ttl, "scope": scope}
    body.update({k: v for k, v in given.items() if v is not None})
    if key:
        body["key"] = key
    out = admin_json("PUT", "/admin/cache/policies", body)
    if "removed" in out:
        _removed(out)
    else:
        _show([out])


def _removed(out: dict[str, Any]) -> None:
    if Ctx.json:
        emit_json(out)
        return
    who = f" for key {out['key']}" if out.get("key") else ""
    what = "removed" if out["removed"] else "there was none"
    console.print(f"cache policy of {out['model']}{who}: {what}", highlight=False)


@app.command("unset")
def cache_unset(model: _MODEL, key: _KEY = "") -> None:
    """Remove an endpoint's cache policy, or a key's (audited as cache.unset); stored answers stay until they
    expire or are flushed."""
    query = f"?model={model}" + (f"&key={key}" if key else "")
    _removed(admin_json("DELETE", "/admin/cache/policies" + query))


@app.command("show")
def cache_show() -> None:
    """Every cache policy."""
    _show(admin_json("GET", "/admin/cache/policies")["data"])


@app.command("stats")
def cache_stats() -> None:
    """Lookups by result (hit-exact, hit-semantic, miss, bypass), stores and stored answers, by model and mode,
    over every gateway replica."""
    out = admin_json("GET", "/admin/cache/stats")
    if Ctx.json:
        emit_json(out)
        return
    results = ("hit-exact", "hit-semantic", "miss", "bypass", "store", "entries")
    table("Response cache", ["model", "mode", *results], [
        [r["model"], r["mode"], *(r[k] for k in results)] for r in out["data"]])
    index = out.get("semantic_index") or {}
    if index:
        console.print("semantic index: " + ", ".join(f"{k} {v}" for k, v in sorted(index.items())), highlight=False)


@app.command("flush")
def cache_flush(model: _MODEL) -> None:
    """Delete every stored answer of an endpoint, in every mode and scope (audited as cache.flush)."""
    out = admin_json("POST", "/admin/cache/flush", {"model": model})
    if Ctx.json:
        emit_json(out)
        return
    console.print(f"{model}: {out['deleted']} stored answers deleted, {out['index_entries']} semantic index "
                  "entries dropped", highlight=False)
