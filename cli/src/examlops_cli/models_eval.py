"""`exa models eval NAME@V`: run the pinned evaluation against a served version, gate it, record it."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import orjson
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from examlops.engine import EngineBlockError, ModelNotFoundError, find_model_file, load_model_file
from examlops.registry.v1 import registry_pb2 as reg

from ._eval import (
    EngineError,
    EvalMetrics,
    GateDecision,
    GateFloor,
    Suite,
    SuiteError,
    decide_gate,
    latest_on_suite,
    load_suite,
    run_eval,
)
from ._output import Ctx, console, emit_json, err_console, fail, table
from ._pack import usecase_dir
from ._rpc import call
from ._versions import get_version
from .models import app

_PHASES = {"texts": "perplexity over the texts", "tasks": "answering the tasks"}


def _floor(name: str) -> tuple[GateFloor, str]:
    """The model's `eval_gate:` from the use-case pack, else the defaults; and where it came from."""
    root = usecase_dir()
    if root is None:
        return GateFloor(), "defaults"
    try:
        path = find_model_file(name, root)
        spec = load_model_file(path)
    except ModelNotFoundError:
        return GateFloor(), "defaults"
    except EngineBlockError as exc:
        fail(f"the pack's model file for {name!r} is invalid:\n{exc}")
    if spec.eval_gate is None:
        return GateFloor(), "defaults"
    return GateFloor.from_mapping(spec.eval_gate.model_dump()), f"eval_gate of {path}"


def _engine(endpoint: str, base_url: str, served_model_name: str, mv: reg.ModelVersion) -> tuple[str, str, str]:
    """(base URL, served model name, target) from a registered endpoint or the explicit options.

    An endpoint that records the version it serves must serve this one (same BOM): the result is
    recorded against this version's files.
    """
    if bool(endpoint) == bool(base_url):
        fail("say what answers: --endpoint NAME (a registered endpoint) or --base-url URL --served-model-name N")
    if base_url:
        if not served_model_name:
            fail("--base-url needs --served-model-name (the model name the server expects)")
        return base_url, served_model_name, f"url:{base_url}"
    ep = call("registry", "GetEndpoint", reg.GetEndpointRequest(name=endpoint))
    if not ep.base_url:
        fail(f"endpoint {endpoint!r} has no address yet ({ep.state_reason or 'not started'})")
    ref = f"{mv.name}@{mv.version}"
    if ep.model_version and ep.model_version != ref and get_version(ep.model_version).bom_sha256 != mv.bom_sha256:
        fail(f"endpoint {endpoint!r} serves {ep.model_version}, not {ref}: evaluate it on an endpoint started "
             f"with --model-version {ref}")
    return ep.base_url, ep.served_model_name or endpoint, f"endpoint:{endpoint}"


def _run(base_url: str, served: str, suite: Suite) -> EvalMetrics:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=Ctx.json) as bar:
        tasks: dict[str, TaskID] = {}

        def note(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done)

        try:
            return run_eval(base_url, served, note, suite=suite)
        except EngineError as exc:
            fail(f"{exc} (nothing was recorded)")


def _show(ref: str, parent_ref: str, parent: reg.EvalResult | None, metrics: EvalMetrics,
          decision: GateDecision, target: str) -> None:
    console.print(f"[bold]{ref}[/] on {metrics.suite} by {target}, {metrics.duration_s:.1f} s", highlight=False)
    rows: list[list[Any]] = [
        ["perplexity", f"{metrics.perplexity:.2f}", f"{parent.perplexity:.2f}" if parent else "-"],
        ["task score", f"{metrics.task_score:.3f} ({metrics.correct}/{metrics.task_count})",
         f"{parent.task_score:.3f} ({round(parent.task_score * parent.task_count)}/{parent.task_count})"
         if parent else "-"],
    ]
    table("Pinned evaluation", ["", ref, f"parent {parent_ref}" if parent_ref else "parent"], rows)
    console.print(f"gate: {decision.gate}", highlight=False, markup=False)
    if decision.passed:
        console.print("[bold green]PASS[/]")
    else:
        console.print(f"[bold red]FAIL[/]: {decision.reason}", highlight=False)


@app.command("eval")
def evalget_version(
    ref: Annotated[str, typer.Argument(metavar="NAME@V", help="The version (or NAME@ALIAS) to evaluate.")],
    endpoint: Annotated[str, typer.Option("--endpoint", "-e", help="Registered endpoint serving it.")] = "",
    base_url: Annotated[str, typer.Option("--base-url", help="An unregistered OpenAI-compatible server.")] = "",
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="With --base-url.")] = "",
) -> None:
    """Perplexity and task score on the pinned suite, gated against the parent; recorded in the registry.

    Exit 0 when the gate passes, 1 when it refuses (the result is recorded either way).
    """
    try:
        suite = load_suite()
    except SuiteError as exc:
        fail(str(exc))
    mv = get_version(ref)
    ref = f"{mv.name}@{mv.version}"
    if mv.degraded:
        fail(f"{ref} is degraded ({mv.degraded_reason or 'its transformation was not run'}): nothing to evaluate")
    parent: reg.EvalResult | None = None
    if mv.parent:
        parent = latest_on_suite(list(get_version(mv.parent).evals), suite.id)
        if parent is None:
            fail(f"{ref}'s parent {mv.parent} has no eval on {suite.id}, so there is nothing to compare "
                 f"with: evaluate the parent first (exa models eval {mv.parent} --endpoint …)")
    floor, floor_source = _floor(mv.name)
    url, served, target = _engine(endpoint, base_url, served_model_name, mv)
    metrics = _run(url, served, suite)
    decision = decide_gate(metrics, parent, floor)
    parent_numbers = {"ref": mv.parent, "perplexity": parent.perplexity, "task_score": parent.task_score,
                      "task_count": parent.task_count, "time_ms": parent.time_ms} if parent else None
    details = {"answers": [dataclasses.asdict(a) for a in metrics.answers], "parent": parent_numbers,
               "floor": dataclasses.asdict(floor), "floor_source": floor_source, "texts": len(suite.texts),
               "scored_tokens": metrics.scored_tokens, "logprob_source": metrics.logprob_source,
               "duration_s": metrics.duration_s, "base_url": url, "served_model_name": served}
    result = reg.EvalResult(
        perplexity=metrics.perplexity, task_score=metrics.task_score, task_count=metrics.task_count,
        suite=suite.id, target=target, passed=decision.passed, gate=decision.gate, reason=decision.reason,
        bom_sha256=mv.bom_sha256, details_json=orjson.dumps(details).decode())
    call("registry", "RecordEval", reg.RecordEvalRequest(name=mv.name, version=mv.version, result=result,
                                                         actor=Ctx.actor()))
    if Ctx.json:
        emit_json({"version": ref, "parent": mv.parent or None, "target": target, **metrics.as_dict(),
                   "parent_perplexity": parent.perplexity if parent else None,
                   "parent_task_score": parent.task_score if parent else None,
                   "passed": decision.passed, "gate": decision.gate, "reason": decision.reason,
                   "floor": dataclasses.asdict(floor), "recorded": True})
    else:
        _show(ref, mv.parent, parent, metrics, decision, target)
    if not decision.passed:
        raise SystemExit(1)
