"""`exa gateway guardrail …`: guardrail policies (detectors × direction × action), attached to
endpoints here and to keys with `exa gateway key issue|update --guardrail NAME`. See
services/gateway/GUARDRAILS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from ._output import Ctx, console, emit_json, fail, table
from .gateway import admin_json

app = typer.Typer(help="Guardrail policies: scan prompts and answers for PII, secrets, deny-listed patterns or a "
                       "judge model's verdict, then block, redact or log.", no_args_is_help=True)


def _groups(detector: list[str], entities: list[str], pattern: list[str], route: list[str], direction: list[str],
            action: list[str], on_error: list[str]) -> list[dict[str, Any]]:
    """Repeated option groups, in order: the i-th --detector takes the i-th --direction and --action; the i-th
    --entities goes to the i-th pii/secrets detector, the i-th --pattern to the i-th regex one, the i-th --route
    and --on-error to the i-th model one."""
    if len(direction) != len(detector) or len(action) != len(detector):
        fail("give one --direction and one --action per --detector")
    entries: list[dict[str, Any]] = [{"detector": d, "direction": direction[i], "action": action[i]}
                                     for i, d in enumerate(detector)]
    for field, values, kinds in (("entities", entities, ("pii", "secrets")), ("pattern", pattern, ("regex",)),
                                 ("route", route, ("model",)), ("on_error", on_error, ("model",))):
        targets = [e for e in entries if e["detector"] in kinds]
        if len(values) > len(targets):
            fail(f"--{field.replace('_', '-')} given {len(values)} times for {len(targets)} "
                 f"{'/'.join(kinds)} detector(s)")
        for entry, value in zip(targets, values, strict=False):
            entry[field] = [v.strip() for v in value.split(",") if v.strip()] if field == "entities" else value
    return entries


@app.command("set")
def guardrail_set(
    name: Annotated[str, typer.Argument(help="Policy name.")],
    detector: Annotated[list[str] | None, typer.Option(
        "--detector", help="pii, secrets, regex or model; repeat for more detectors.")] = None,
    direction: Annotated[list[str] | None, typer.Option(
        "--direction", help="input, output or both: one per --detector, in order.")] = None,
    action: Annotated[list[str] | None, typer.Option(
        "--action", help="block, redact or log: one per --detector, in order.")] = None,
    entities: Annotated[list[str] | None, typer.Option(
        "--entities", help="A,B: entity types, for the pii/secrets detectors in order (default: all).")] = None,
    pattern: Annotated[list[str] | None, typer.Option(
        "--pattern", help="Deny-list regex, for the regex detectors in order (bounded repeats only).")] = None,
    route: Annotated[list[str] | None, typer.Option(
        "--route", help="Judge route, for the model detectors in order.")] = None,
    on_error: Annotated[list[str] | None, typer.Option(
        "--on-error", help="block (default: fail closed) or allow, for the model detectors in order.")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", help="A YAML file `detectors: [{detector, direction, action, entities, pattern, route, "
                       "timeout_s, on_error}]` instead of the options.", exists=True, dir_okay=False)] = None,
) -> None:
    """Create or replace a policy (audited as guardrail.set); every gateway replica applies it within a second.

    Example: `exa gateway guardrail set no-pii --detector pii --entities EMAIL_ADDRESS,PHONE_NUMBER
    --direction both --action redact --detector secrets --direction input --action block`.
    """
    if file is not None:
        body = yaml.safe_load(file.read_text())
        if not isinstance(body, dict):
            fail(f"{file}: a mapping with a `detectors` list")
    elif detector:
        body = {"detectors": _groups(detector, entities or [], pattern or [], route or [], direction or [],
                                     action or [], on_error or [])}
    else:
        fail("give --detector groups or --file")
    _show([admin_json("PUT", f"/admin/guardrails/{name}", body)])


def _show(rows: list[dict[str, Any]]) -> None:
    if Ctx.json:
        emit_json(rows)
        return
    table("Guardrail policies", ["name", "detector", "direction", "action", "entities / pattern / route",
                                 "endpoints", "keys"], [
        [r["name"] if i == 0 else "", d["detector"], d["direction"], d["action"],
         ",".join(d.get("entities", [])) or d.get("pattern") or d.get("route", ""),
         ",".join(r.get("endpoints", [])) if i == 0 else "", ",".join(r.get("keys", [])) if i == 0 else ""]
        for r in rows for i, d in enumerate(r["detectors"])])


@app.command("list")
def guardrail_list() -> None:
    """Every policy, its detectors, and the endpoints and keys it is attached to."""
    _show(admin_json("GET", "/admin/guardrails")["data"])


@app.command("delete")
def guardrail_delete(name: Annotated[str, typer.Argument(help="Policy name.")]) -> None:
    """Delete a policy (refused while it is attached to an endpoint or a key; audited)."""
    admin_json("DELETE", f"/admin/guardrails/{name}")
    console.print(f"guardrail policy {name} deleted", highlight=False)


def _attachment(verb: str, name: str, model: str) -> None:
    out = admin_json("POST", f"/admin/guardrails/{name}/{verb}", {"model": model})
    if Ctx.json:
        emit_json(out)
        return
    console.print(f"{model}: {', '.join(out['policies']) or 'no guardrail policy'}", highlight=False)


@app.command("attach")
def guardrail_attach(name: Annotated[str, typer.Argument(help="Policy name.")],
                     model: Annotated[str, typer.Option("--model", help="Endpoint (route name).")]) -> None:
    """Apply a policy to every call of an endpoint, whatever the key (audited)."""
    _attachment("attach", name, model)


@app.command("detach")
def guardrail_detach(name: Annotated[str, typer.Argument(help="Policy name.")],
                     model: Annotated[str, typer.Option("--model", help="Endpoint (route name).")]) -> None:
    """Stop applying a policy to an endpoint (audited)."""
    _attachment("detach", name, model)


@app.command("test")
def guardrail_test(name: Annotated[str, typer.Argument(help="Policy name.")],
                   text: Annotated[str, typer.Option("--text", help="The text to scan.")],
                   run_judges: Annotated[bool, typer.Option(
                       "--run-judges", help="Also ask the policy's model detectors (calls their routes).")] = False,
                   ) -> None:
    """What each detector of a policy finds in TEXT (entity, span, the matched text), without calling a model:
    model detectors are listed as skipped unless --run-judges. Nothing is logged."""
    out = admin_json("POST", f"/admin/guardrails/{name}/test", {"text": text, "run_judges": run_judges})
    if Ctx.json:
        emit_json(out)
        return
    rows = [[r["index"], r["detector"], f["entity"], f"{f['start']}-{f['end']}", f["text"], r["action"]]
            for r in out["results"] for f in r["findings"]]
    rows += [[r["index"], r["detector"], "error", "", r["error"], ""] for r in out["results"] if r.get("error")]
    rows += [[r["index"], r["detector"], "skipped", "", r["skipped"], ""] for r in out["results"] if r.get("skipped")]
    table(f"Guardrail {name}: findings", ["#", "detector", "entity", "span", "text", "action"], rows)
    if not rows:
        console.print("nothing found", highlight=False)
