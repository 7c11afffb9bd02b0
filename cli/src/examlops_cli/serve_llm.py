"""`exa serve llm …`: start, list, health, chat, stop (status and pool changes: serve_llm_pool)."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Annotated, Any

import grpc
import orjson
import typer
from rich.markup import escape

from examlops.engine import ROUTINGS
from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops.launcher.v1 import launcher_pb2 as la
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import error_reason, parse_state, state_name

from ._chat import build_messages
from ._output import (
    Ctx,
    console,
    emit_json,
    endpoint_dict,
    err_console,
    fail,
    message_dict,
    pool_line,
    replicas_ready,
    table,
)
from ._pack import check_block, media_policy, pack_block
from ._rpc import call, rpc_fail, stub

app = typer.Typer(help="Serve LLMs and VLMs with vLLM: one command surface on every substrate.",
                  no_args_is_help=True)

Model = Annotated[str, typer.Argument(help="Endpoint name (also its gateway route).")]


@app.command()
def start(
    model: Model,
    base_url: Annotated[list[str] | None, typer.Option(
        help="Where the server listens (external launcher); repeat it once per replica.")] = None,
    replicas: Annotated[int | None, typer.Option(
        help="Servers in the pool (default 1; external: one per --base-url).")] = None,
    routing: Annotated[str, typer.Option(
        help=f"How engine-proxy picks a replica per request: {' | '.join(ROUTINGS)} (the block's routing; "
             "default least-load).")] = "",
    hf_model: Annotated[str, typer.Option(help="Weights to serve, e.g. Qwen/Qwen3-VL-8B-Instruct.")] = "",
    launcher: Annotated[str, typer.Option(help="external | compose | slurm | flux | kserve.")] = "external",
    engine: Annotated[str, typer.Option(help="Engine: vllm, vllm-server, vllm-inproc, sglang, echo.")] = "",
    served_model_name: Annotated[str, typer.Option(help="Model name the server expects.")] = "",
    project: Annotated[str, typer.Option(help="Project the endpoint is attributed to.")] = "",
    nodes: Annotated[int, typer.Option(help="Nodes of the allocation (slurm, flux, kserve).")] = 1,
    gpus: Annotated[int, typer.Option(help="GPUs PER NODE: --nodes 2 --gpus 4 is eight GPUs.")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="Tensor parallel size (within a node); overrides the block.")] = 0,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline parallel size (across nodes); overrides the block.")] = 0,
    partition: Annotated[str, typer.Option(help="Scheduler partition (queue).")] = "",
    walltime: Annotated[str, typer.Option(help="Job time limit, e.g. 04:00:00.")] = "",
    port: Annotated[int, typer.Option(help="Serving port on the node (default: the block's, else 8000).")] = 0,
    modality: Annotated[str, typer.Option(help="text | vision | audio | video (the block's multimodal).")] = "",
    max_images: Annotated[int, typer.Option(help="Images per prompt (vision's limit_mm_per_prompt).")] = 0,
    media_domains: Annotated[list[str] | None, typer.Option(
        help="Allowed media domain (repeatable; subdomains included). None: no remote media.")] = None,
    replace: Annotated[bool, typer.Option("--replace", help="Replace a STARTING or READY endpoint.")] = False,
    model_version: Annotated[str, typer.Option(
        help="Serve a registered version, NAME@V or NAME@ALIAS: verified (trusted signature, every file "
             "re-hashed), then its folder is the model.")] = "",
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print exactly what would be submitted; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Start (or, with the external launcher, register) an endpoint: one server or a pool of replicas.

    The engine block comes from the use-case pack when it has the model
    ($EXAMLOPS_USECASE_DIR, or ./usecases); the flags given here override it.
    A pool of external servers: --base-url http://a:8000 --base-url http://b:8000 --routing prefix.
    """
    base_urls = pool_addresses(launcher, base_url or [], replicas)
    block = pack_block(model) or {}
    overrides = {"engine": engine, "hf_model_id": hf_model, "base_url": base_urls[0] if base_urls else "",
                 "served_model_name": served_model_name, "routing": routing}
    block.update({k: v for k, v in overrides.items() if v})
    if modality or max_images or media_domains:
        block["multimodal"] = media_policy(block.get("multimodal") or {}, modality, max_images, media_domains or [])
    served = None
    if model_version:
        block, served = serve_version(block, model_version)
    if block:
        check_block(block)
        for other in base_urls[1:]:  # every replica's address passes the block's base_url rule
            check_block({**block, "base_url": other})
    first = base_urls[0] if base_urls else str(block.get("base_url") or "")
    req = la.StartRequest(name=model, launcher=launcher, base_url=first, hf_model=hf_model,
                          engine_block_json=orjson.dumps(block).decode() if block else "",
                          project=project, actor=Ctx.actor(), replace=replace, nodes=nodes,
                          gpus_per_node=gpus, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          partition=partition, walltime=walltime, port=port,
                          model_version=f"{served.name}@{served.version}" if served else "",
                          replicas=replicas or len(base_urls) or 1,
                          base_urls=base_urls if launcher == "external" else [])
    plan = call("launcher", "Plan", req)
    if dry_run:
        emit_json(message_dict(plan)) if Ctx.json else print_plan(plan)
        return
    if launcher != "external" and not yes:
        confirm(plan.summary)
    resp = call("launcher", "Start", req, timeout=max(Ctx.settings().rpc_timeout_s, 120))
    if Ctx.json:
        emit_json(endpoint_dict(resp.endpoint))
        return
    ep = resp.endpoint
    console.print(f"endpoint [bold]{ep.name}[/] registered: {state_name(ep.state)} "
                  f"{ep.base_url or '(no address)'} via {ep.launcher}"
                  + (f"{' job ' + ep.job_id if ep.job_id else ''} — {escape(ep.state_reason)}"
                     if ep.state_reason else ""), highlight=False)
    if len(ep.replicas) > 1:
        console.print(f"{replicas_ready(ep)} replicas ready: {pool_line(ep)}", highlight=False)


def pool_addresses(launcher: str, base_urls: list[str], replicas: int | None) -> list[str]:
    """The --base-url list, checked against --replicas: the external launcher takes one per replica."""
    if replicas is not None and replicas < 1:
        fail(f"--replicas {replicas}: a pool has at least 1 replica")
    if len(set(base_urls)) != len(base_urls):
        fail("--base-url: each replica needs its own address (an address is given twice)")
    if launcher == "external" and replicas is not None and replicas != max(len(base_urls), 1):
        fail(f"--replicas {replicas} with {len(base_urls)} --base-url: the external launcher registers "
             "one replica per --base-url (give one --base-url per replica)")
    if launcher != "external" and len(base_urls) > 1:
        fail(f"--base-url is given {len(base_urls)} times: only the external launcher takes one per replica "
             f"(launcher {launcher!r} starts the servers; use --replicas N)")
    return base_urls


def serve_version(block: dict[str, Any], ref: str) -> tuple[dict[str, Any], reg.ModelVersion]:
    """The block serving a verified model version (see _versions.servable_version)."""
    from ._versions import apply_version, servable_version

    mv = servable_version(ref)
    block, notes = apply_version(block, mv)
    for note in notes:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    return block, mv


def print_plan(plan: la.LaunchPlan) -> None:
    """Exactly what would be submitted, verbatim (no markup): script, manifest, files, env, commands."""
    out = [f"# {plan.summary}"]
    if plan.script:
        out += ["# --- job script ---", plan.script.rstrip("\n")]
    if plan.manifest:
        out += ["# --- manifest ---", plan.manifest.rstrip("\n")]
    for path, content in plan.files.items():
        if content not in (plan.script, plan.manifest):
            out += [f"# --- file {path} ---", content.rstrip("\n")]
    if plan.env:
        out += ["# --- environment (secrets redacted) ---", *[f"{k}={v}" for k, v in sorted(plan.env.items())]]
    if plan.argv:
        out += ["# --- engine argv ---", shlex.join(plan.argv)]
    if plan.commands:
        out += ["# --- commands ---", *plan.commands]
    typer.echo("\n".join(out))


def confirm(summary: str) -> None:
    try:
        agreed = typer.confirm(f"{summary}\nProceed?")
    except (typer.Abort, EOFError):
        agreed = False
    if not agreed:
        fail("cancelled (pass --yes to skip the confirmation)")


@app.command("list")
def list_(
    project: Annotated[str, typer.Option(help="Only this project.")] = "",
    state: Annotated[list[str] | None, typer.Option(help="Only these states (repeatable).")] = None,
) -> None:
    """Registered endpoints; `replicas` is ready/total (READY and not draining, of the pool)."""
    try:
        states: list[Any] = [parse_state(s) for s in state or []]
    except ValueError as exc:
        fail(str(exc))
    resp = call("registry", "ListEndpoints", reg.ListEndpointsRequest(project=project, states=states))
    if Ctx.json:
        emit_json([endpoint_dict(e) for e in resp.endpoints])
        return
    table("Endpoints", ["name", "state", "replicas", "engine", "launcher", "base_url", "project", "job"],
          [[e.name, state_name(e.state), replicas_ready(e), e.engine, e.launcher, e.base_url, e.project, e.job_id]
           for e in resp.endpoints])


@app.command()
def health(model: Model) -> None:
    """Probe the server and reconcile the recorded state; exit 1 when not ready (a CI gate)."""
    resp = call("launcher", "Health", la.HealthRequest(name=model, actor=Ctx.actor()),
                timeout=max(Ctx.settings().rpc_timeout_s, 60))
    if Ctx.json:
        emit_json({"ready": resp.ready, "detail": resp.detail, "endpoint": endpoint_dict(resp.endpoint)})
    else:
        mark = "[green]ready[/]" if resp.ready else "[red]not ready[/]"
        console.print(f"{model}: {mark} ({state_name(resp.endpoint.state)}) — {escape(resp.detail)}", highlight=False)
    raise SystemExit(0 if resp.ready else 1)


@app.command()
def stop(
    model: Model,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what the stop would run; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Stop the endpoint (cancel its HPC job or stop its compose service) and mark it STOPPED."""
    timeout = max(Ctx.settings().rpc_timeout_s, 120)
    preview = call("launcher", "Stop", la.StopRequest(name=model, actor=Ctx.actor(), dry_run=True), timeout=timeout)
    if dry_run:
        emit_json(message_dict(preview.plan)) if Ctx.json else print_plan(preview.plan)
        return
    if preview.endpoint.launcher not in ("", "external") and not yes:
        confirm(preview.plan.summary)
    resp = call("launcher", "Stop", la.StopRequest(name=model, actor=Ctx.actor()), timeout=timeout)
    if Ctx.json:
        emit_json(endpoint_dict(resp.endpoint))
    else:
        console.print(f"endpoint [bold]{model}[/] {state_name(resp.endpoint.state)}"
                      + (f" — {escape(resp.endpoint.state_reason)}" if resp.endpoint.state_reason else ""),
                      highlight=False)


def learn_published_address(model: str) -> None:
    """An HPC job publishes its address in an endpoint file: have the launcher read and record it first.

    Only for a slurm/flux endpoint that has no address yet; any error is left to the chat itself.
    """
    try:
        ep = stub("registry").GetEndpoint(reg.GetEndpointRequest(name=model), timeout=Ctx.settings().rpc_timeout_s)
        if ep.launcher not in ("slurm", "flux") or ep.base_url or ep.state in (
                reg.ENDPOINT_STATE_STOPPED, reg.ENDPOINT_STATE_DISABLED):
            return
        found = stub("launcher").Health(la.HealthRequest(name=model, actor=Ctx.actor()), timeout=60)
    except grpc.RpcError:
        return
    if found.endpoint.base_url:  # engine-proxy learns the new address from its registry watch
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            routes = stub("engine-proxy").ListRoutes(ep_pb.ListRoutesRequest(), timeout=5).routes
            if any(r.name == model and r.base_url == found.endpoint.base_url for r in routes):
                return
            time.sleep(0.05)


@app.command()
def chat(
    model: Model,
    message: Annotated[str, typer.Option("--message", "-m", help="The user message.")],
    image: Annotated[list[str] | None, typer.Option(
        help="Image path or URL (repeatable); local files are inlined as data: URLs.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they arrive.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.")] = 256,
) -> None:
    """Chat with the endpoint directly through engine-proxy (no key, no budget; media guard applies)."""
    learn_published_address(model)
    try:
        messages = build_messages(message, image or [])
    except ValueError as exc:
        fail(str(exc))
    body = {"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens}
    req = ep_pb.GenerateRequest(endpoint=model, kind=ep_pb.REQUEST_KIND_CHAT, body_json=orjson.dumps(body))
    text, usage, dropped, notes = [], None, 0, []
    try:
        for chunk in stub("engine-proxy").Generate(req, timeout=Ctx.settings().rpc_timeout_s * 40):
            dropped = dropped or chunk.media_parts_dropped
            notes.extend(chunk.warnings)
            if chunk.HasField("usage"):
                usage = chunk.usage
            # a message carries one chunk's JSON (data) or the SSE frames of several (sse)
            events = [f[6:] for f in chunk.sse.split(b"\n\n") if f] if chunk.sse else [chunk.data]
            for obj in (orjson.loads(e) for e in events if e):
                for choice in obj.get("choices", []):
                    piece = (choice.get("delta" if stream else "message") or {}).get("content")
                    if piece:
                        text.append(piece)
                        if stream and not Ctx.json:
                            sys.stdout.write(piece)
                            sys.stdout.flush()
    except grpc.RpcError as exc:
        reason, param = error_reason(exc)
        if reason and reason.startswith("media_"):
            fail(f"{reason}: {exc.details()} (at {param})")
        rpc_fail("engine-proxy", exc)
    for note in notes:
        err_console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    if Ctx.json:
        counts = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens} if usage else None
        emit_json({"content": "".join(text), "usage": counts, "media_parts_dropped": dropped, "warnings": notes})
    elif stream:
        sys.stdout.write("\n")
    else:
        console.print("".join(text), highlight=False)
