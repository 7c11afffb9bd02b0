"""`exa serve challenger …`: a judge route that grades free-form answers, once it has earned it.

The judge is whatever endpoint is registered under the `--judge-model` route (default `judge`); it is
asked through the gateway (see _judge.py for the prompt and the answer it must give). Its verdicts may
gate only after `calibrate` has measured its agreement with a labelled set and the registry holds a
passed calibration for exactly the endpoint that answers now.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from examlops.registry.v1 import registry_pb2 as reg

from ._judge import GatewayError, Item, JudgeClient, SetError, Verdict, endpoint_fingerprint, load_set
from ._output import Ctx, console, emit_json, err_console, fail, message_dict, table
from ._rpc import call, rpc_fail, stub

app = typer.Typer(
    help="Challenger evaluation: a judge route grades free-form answers through the gateway. A judge must "
         "first be calibrated against a labelled set (`calibrate`); `judge` refuses until it has passed.",
    no_args_is_help=True)

MIN_ITEMS = 10
MIN_THRESHOLD = 0.5
JudgeModel = Annotated[str, typer.Option(
    "--judge-model", help="Route (endpoint name) of the judge in the gateway.")]


def _calibrate_hint(route: str) -> str:
    return f"exa serve challenger calibrate --judge-model {route} --set FILE"


def _read_set(path: Path, labelled: bool) -> tuple[bytes, list[Item]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"--set {path}: cannot read it ({exc.strerror or type(exc).__name__})")
    try:
        items = load_set(data, str(path), labelled)
    except SetError as exc:
        fail(str(exc))
    if not items:
        fail(f"--set {path}: no items")
    return data, items


def _judge_endpoint(route: str) -> reg.Endpoint:
    try:
        ep: reg.Endpoint = stub("registry").GetEndpoint(reg.GetEndpointRequest(name=route),
                                                        timeout=Ctx.settings().rpc_timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            fail(f"no endpoint named {route!r} to act as the judge: register one under that name "
                 f"(exa serve llm start {route} ...) or pick another with --judge-model")
        rpc_fail("registry", exc)
    return ep


def _calibration(route: str) -> reg.JudgeCalibration | None:
    try:
        cal: reg.JudgeCalibration = stub("registry").GetJudgeCalibration(
            reg.GetJudgeCalibrationRequest(route=route), timeout=Ctx.settings().rpc_timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        rpc_fail("registry", exc)
    return cal if cal.route else None


def _run(route: str, items: list[Item], what: str, on_failure: str) -> list[Verdict]:
    """Ask the judge about every item, in order, with a progress bar on stderr; a gateway failure ends
    the run (exit 1, the message ending with `on_failure`)."""
    s = Ctx.settings()
    client = JudgeClient(s.gateway_url, s.admin_key.get_secret_value(), route, Ctx.actor())
    verdicts: list[Verdict] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err_console, transient=True, disable=Ctx.json or len(items) == 1) as bar:
            task = bar.add_task(f"{what} with {route}", total=len(items))
            for item in items:
                verdicts.append(client.ask(item))
                bar.advance(task)
    except GatewayError as exc:
        fail(f"{exc}; {on_failure}")
    finally:
        client.close()
    return verdicts


def _score(v: Verdict) -> str:
    return "-" if v.score is None else f"{v.score:.2f}"


@app.command()
def calibrate(
    set_file: Annotated[Path, typer.Option(
        "--set", help="Labelled JSONL set: one object per line with question, answer, label (pass or fail) and "
                      "optionally reference and id; at least 10 items.")],
    judge_model: JudgeModel = "judge",
    threshold: Annotated[float, typer.Option(
        help="Share of the set the judge must agree with for its verdicts to be used (0.5 to 1).")] = 0.8,
) -> None:
    """Measure how often the judge route agrees with a labelled set and record it in the registry.

    Every item goes to the judge through the gateway. Agreement is the share
    of items whose verdict equals the label; an item the judge gives no
    verdict on counts as a disagreement. The calibration is recorded with the
    set's sha256 and the judge endpoint's fingerprint (served model, engine
    block, creation time): a judge whose model is replaced needs a new one.

    Exit 0 when the agreement reaches the threshold; 1 when it does not (the
    failed calibration is recorded all the same) or when the gateway could
    not ask the judge (then nothing is recorded).
    """
    if not MIN_THRESHOLD <= threshold <= 1:
        fail(f"--threshold {threshold:g}: give a share from {MIN_THRESHOLD} to 1 "
             "(below 0.5 a pass/fail judge agrees no better than a coin)")
    data, items = _read_set(set_file, labelled=True)
    if len(items) < MIN_ITEMS:
        fail(f"--set {set_file}: {len(items)} item(s); a calibration needs at least {MIN_ITEMS}")
    fingerprint = endpoint_fingerprint(_judge_endpoint(judge_model))
    verdicts = _run(judge_model, items, "calibrating", "no verdict, nothing recorded")
    if endpoint_fingerprint(_judge_endpoint(judge_model)) != fingerprint:
        fail(f"the endpoint {judge_model!r} was replaced while it was being calibrated; nothing recorded, "
             "run the calibration again")

    confusion = Counter((item.label, v.verdict or "none") for item, v in zip(items, verdicts, strict=True))
    agreed = confusion["pass", "pass"] + confusion["fail", "fail"]
    agreement = agreed / len(items)
    recorded = call("registry", "RecordJudgeCalibration", reg.RecordJudgeCalibrationRequest(
        calibration=reg.JudgeCalibration(
            route=judge_model, agreement=agreement, threshold=threshold, samples=len(items),
            set_sha256=hashlib.sha256(data).hexdigest(), passed=agreement >= threshold,
            endpoint_fingerprint=fingerprint),
        actor=Ctx.actor()))
    passed = bool(recorded.passed)
    disagreements = [{"line": item.line, "label": item.label, "verdict": v.verdict, "score": v.score,
                      "reason": v.reason}
                     for item, v in zip(items, verdicts, strict=True) if v.verdict != item.label]
    if Ctx.json:
        emit_json({"calibration": message_dict(recorded), "agreed": agreed,
                   "confusion": {f"{label}->{verdict}": n for (label, verdict), n in sorted(confusion.items())},
                   "disagreements": disagreements})
    else:
        table(f"Calibration of judge {judge_model!r} ({set_file})", ["", "value"], [
            ["agreement", f"{agreement:.3f} ({agreed}/{len(items)})"], ["threshold", f"{threshold:g}"],
            ["samples", len(items)],
            ["label pass: judged pass / fail / no verdict",
             f"{confusion['pass', 'pass']} / {confusion['pass', 'fail']} / {confusion['pass', 'none']}"],
            ["label fail: judged pass / fail / no verdict",
             f"{confusion['fail', 'pass']} / {confusion['fail', 'fail']} / {confusion['fail', 'none']}"],
            ["result", "[green]passed[/]" if passed else "[red]failed[/]"]])
        if disagreements:
            console.print("disagreed on line(s) " + ", ".join(str(d["line"]) for d in disagreements),
                          highlight=False)
        console.print(f"recorded in the registry; `exa serve challenger judge --judge-model {judge_model}` "
                      + ("may now use it" if passed else "refuses it until a calibration passes"), highlight=False)
    raise typer.Exit(0 if passed else 1)


def _require_calibrated(route: str) -> reg.JudgeCalibration:
    """The route's calibration, if it passed for the endpoint answering now; otherwise exit 1 naming the fix."""
    ep = _judge_endpoint(route)
    cal = _calibration(route)
    fix = f"run `{_calibrate_hint(route)}`"
    if cal is None:
        fail(f"judge route {route!r} is not calibrated: its verdicts may not be used until a calibration "
             f"against a labelled set passes; {fix}")
    if not cal.passed:
        fail(f"judge route {route!r} failed its last calibration (agreement {cal.agreement:.3f} below the "
             f"threshold {cal.threshold:g} on {cal.samples} items); improve or replace the judge, then {fix}")
    if cal.endpoint_fingerprint != endpoint_fingerprint(ep):
        fail(f"the endpoint {route!r} is not the one that was calibrated (it now serves "
             f"{ep.served_model_name!r} or was otherwise replaced): a replaced judge must be recalibrated; {fix}")
    return cal


@app.command()
def judge(
    judge_model: JudgeModel = "judge",
    question: Annotated[str, typer.Option(help="The question the answer responds to.")] = "",
    answer: Annotated[str, typer.Option(help="The free-form answer to grade.")] = "",
    reference: Annotated[str, typer.Option(help="A reference answer the judge compares with (optional).")] = "",
    set_file: Annotated[Path | None, typer.Option(
        "--set", help="JSONL of items to grade instead of --question/--answer: question, answer, optional "
                      "reference and id (a label, if present, is ignored).")] = None,
) -> None:
    """Grade answers with the calibrated judge route: a pass/fail verdict and a score from 0 to 1 each.

    Refuses (exit 1) unless the registry holds a passed calibration for the
    route, made with the endpoint that answers now (see `exa serve challenger
    calibrate`). Exit 0 when every item got a verdict; 1 when the judge gave
    no verdict on some item or the gateway could not ask it.
    """
    if set_file is not None and (question or answer or reference):
        fail("give either --set FILE or --question/--answer/--reference, not both")
    if set_file is None and not (question.strip() and answer.strip()):
        fail("give --question and --answer (and optionally --reference), or --set FILE")
    items = _read_set(set_file, labelled=False)[1] if set_file is not None else [
        Item(0, question, answer, reference)]
    cal = _require_calibrated(judge_model)
    verdicts = _run(judge_model, items, "judging", "no verdict")
    missing = sum(v.verdict is None for v in verdicts)
    if Ctx.json:
        results: list[dict[str, Any]] = [
            {**({"line": i.line} if set_file is not None else {}), "question": i.question,
             "verdict": v.verdict, "score": v.score, **({"reason": v.reason} if v.verdict is None else {})}
            for i, v in zip(items, verdicts, strict=True)]
        emit_json({"route": judge_model, "calibration": message_dict(cal), "results": results})
    elif set_file is None:
        _print_one(verdicts[0])
    else:
        table(f"Verdicts of judge {judge_model!r}", ["line", "verdict", "score", "question"], [
            [i.line, v.verdict or f"(no verdict: {v.reason})", _score(v), _short(i.question)]
            for i, v in zip(items, verdicts, strict=True)])
    if missing:
        fail(f"the judge gave no verdict on {missing} of {len(items)} item(s)")


def _print_one(v: Verdict) -> None:
    text = escape(f"{v.verdict}  score {_score(v)}" if v.verdict else f"(no verdict: {v.reason})")
    color = {"pass": "green", "fail": "red"}.get(v.verdict or "")
    console.print(f"[{color}]{text}[/]" if color else text, highlight=False)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
