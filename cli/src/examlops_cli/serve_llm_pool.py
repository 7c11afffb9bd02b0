"""`exa serve llm status | scale | replica add | replica remove`: an endpoint's pool of replicas."""

from __future__ import annotations

import time
from typing import Annotated, Any

import grpc
import typer
from google.protobuf.message import Message
from rich.markup import escape

from examlops.engine import EngineBlockError, parse_engine_block
from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops.launcher.v1 import launcher_pb2 as la
from examlops.registry.v1 import registry_pb2 as reg

from ._output import Ctx, console, emit_json, endpoint_dict, fail, message_dict, pool_line, replicas_ready, table
from ._rpc import call, stub
from .serve_llm import Model, app, confirm, print_plan

replica_app = typer.Typer(help="Add or remove one server of a live pool.", no_args_is_help=True)
app.add_typer(replica_app, name="replica")

DrainTimeout = Annotated[float, typer.Option(
    min=0, help="Longest wait, in seconds, for a removed replica's in-flight requests to finish.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would change and run; change nothing.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


@app.command()
def status(model: Model) -> None:
    """Registry record, the substrate's view, each replica's live load and engine-proxy's routing.

    The Replicas table is the launcher's live view (its /metrics; the prefix-cache hit rate, cached
    prompt tokens / prompt tokens looked up, and the speculative-decoding acceptance rate, accepted /
    proposed draft tokens, count since each server started); the Routing table is what
    engine-proxy knows of each replica: healthy or ejected, its requests in flight, and its counters
    (requests, errors, ejections, retries, picks by reason) since that engine-proxy started.
    """
    resp = call("launcher", "Status", la.StatusRequest(name=model), timeout=max(Ctx.settings().rpc_timeout_s, 60))
    route, proxy_error = proxy_route(model)
    sources = {r.id: r.source for r in resp.endpoint.replicas}
    replicas = [{**flat_dict(r), "source": sources.get(r.id, "")} for r in resp.replicas]
    routing = routing_dict(route) if route else None
    if Ctx.json:
        emit_json({"endpoint": endpoint_dict(resp.endpoint), "substrate": dict(resp.substrate),
                   "metrics": dict(resp.metrics), "replicas": replicas, "routing": routing,
                   **({"routing_error": proxy_error} if proxy_error else {})})
        return
    ep = endpoint_dict(resp.endpoint)
    table(f"Endpoint {model}", ["field", "value"],
          [[k, v] for k, v in ep.items() if k not in ("engine_block", "replicas")])
    if resp.substrate:
        table("Substrate", ["field", "value"], sorted(resp.substrate.items()))
    if resp.metrics:
        table("vLLM metrics (live, from /metrics, summed over replicas)", ["metric", "value"],
              [[k, f"{v:.4g}"] for k, v in sorted(resp.metrics.items())])
    if replicas:
        table(f"Replicas ({replicas_ready(resp.endpoint)} ready)",
              ["id", "state", "base_url", "running", "waiting", "kv cache", "prefix hits", "spec accept", "draining",
               "source", "detail"],
              [[r["id"], r["state"], r["base_url"], _metric(r, "requests_running"), _metric(r, "requests_waiting"),
                _metric(r, "kv_cache_usage", "{:.0%}"), _metric(r, "prefix_cache_hit_rate", "{:.1%}"),
                _metric(r, "spec_decode_acceptance_rate", "{:.1%}"), "yes" if r["draining"] else "", r["source"],
                r["detail"]]
               for r in replicas])
    if proxy_error:
        console.print(f"[yellow]routing not shown:[/] {escape(proxy_error)}", highlight=False)
    elif routing is None:
        console.print(f"engine-proxy has no route for {model} (not routed)", highlight=False)
    elif not routing["replicas"]:
        console.print(f"engine-proxy routes {model} ({routing['state']}) with no replica to pick", highlight=False)
    else:
        table(f"Routing (engine-proxy): {routing['policy']}",
              ["id", "health", "in flight", "requests", "errors", "ejections", "retries", "picks"],
              [[s["id"], _health(s), s["in_flight"], s["requests"], s["errors"], s["ejections"], s["retries"],
                " ".join(f"{k}={v}" for k, v in sorted(s["picks"].items())) or "-"] for s in routing["replicas"]])


def proxy_route(model: str) -> tuple[ep_pb.Route | None, str]:
    """engine-proxy's route of the model, or why it cannot be read (the rest of status still shows)."""
    try:
        routes = stub("engine-proxy").ListRoutes(ep_pb.ListRoutesRequest(name=model), timeout=5).routes
    except grpc.RpcError as exc:
        where = Ctx.settings().engine_proxy_addr
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None, f"cannot reach engine-proxy at {where} (set EXAMLOPS_ENGINE_PROXY_ADDR)"
        return None, f"engine-proxy at {where}: {exc.details() or exc.code().name}"
    return next((r for r in routes if r.name == model), None), ""


def routing_dict(route: ep_pb.Route) -> dict[str, Any]:
    return {"policy": route.routing, "state": route.state, "routable": route.routable,
            "replicas": [flat_dict(s) for s in route.replicas]}


def flat_dict(msg: Message) -> dict[str, Any]:
    """A message of scalars and maps as plain values (int64 stays a number, unlike MessageToDict)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        out[field.name] = dict(value) if hasattr(value, "items") else value
    return out


def _metric(replica: dict[str, Any], name: str, fmt: str = "{:g}") -> str:
    value = replica["metrics"].get(name)
    return "-" if value is None else fmt.format(value)


def _health(stats: dict[str, Any]) -> str:
    words = [] if not stats["draining"] else ["draining"]
    if stats["healthy"]:
        words.insert(0, "healthy")
    else:
        wait_s = max(0.0, stats["ejected_until_ms"] / 1000 - time.time())
        words.insert(0, f"ejected (probe in {wait_s:.1f} s)")
    return ", ".join(words)


@app.command()
def scale(
    model: Model,
    replicas: Annotated[int, typer.Argument(metavar="N", help="Replicas the pool should have (at least 1).")],
    drain_timeout: DrainTimeout = 30.0,
    dry_run: DryRun = False,
    yes: Yes = False,
) -> None:
    """Change the number of replicas of a live endpoint.

    New replicas start as `start` would (same block, same launcher).
    Surplus ones, the newest first, get no new request, finish their in-flight ones (up to --drain-timeout), then stop.
    An external pool is not ours to start: grow it with `exa serve llm replica add`.
    """
    if replicas < 1:
        fail(f"scale {model} {replicas}: a pool keeps at least 1 replica (to stop it: exa serve llm stop {model})")
    req = la.ScaleRequest(name=model, replicas=replicas, drain_timeout_s=drain_timeout, dry_run=True)
    change("Scale", req, drain_timeout, dry_run, yes)


@replica_app.command("add")
def replica_add(
    model: Model,
    base_url: Annotated[str, typer.Option(help="The running server to add, e.g. http://gpu02:8000.")],
) -> None:
    """Add a running OpenAI-compatible server to the pool (any launcher: the server is not ours to stop)."""
    try:
        parse_engine_block({"base_url": base_url})  # the rule every replica address passes
    except EngineBlockError as exc:
        fail("--base-url " + "; ".join(i.line().removeprefix("engine.base_url: ") for i in exc.issues))
    resp = call("launcher", "AddReplica", la.AddReplicaRequest(name=model, base_url=base_url),
                timeout=max(Ctx.settings().rpc_timeout_s, 60))
    show_change(resp, dry_run=False)


@replica_app.command("remove")
def replica_remove(
    model: Model,
    replica: Annotated[str, typer.Argument(help="Replica id (r1) or its base_url.")],
    drain_timeout: DrainTimeout = 30.0,
    dry_run: DryRun = False,
    yes: Yes = False,
) -> None:
    """Drain a replica (no new requests, in-flight ones finish), stop its job if we started it, forget it.

    The last replica cannot be removed: stop the endpoint instead.
    """
    req = la.RemoveReplicaRequest(name=model, replica=replica, drain_timeout_s=drain_timeout, dry_run=True)
    change("RemoveReplica", req, drain_timeout, dry_run, yes)


def change(method: str, req: Any, drain_timeout: float, dry_run: bool, yes: bool) -> None:
    """A pool change: a dry run prints it; otherwise confirm when it runs on the substrate, then do it."""
    timeout = max(Ctx.settings().rpc_timeout_s, 120) + drain_timeout
    if dry_run:
        show_change(call("launcher", method, req, timeout=timeout), dry_run=True)
        return
    if not yes and runs_on_substrate(call("registry", "GetEndpoint", reg.GetEndpointRequest(name=req.name)), req):
        preview = call("launcher", method, req, timeout=timeout)
        confirm("\n".join([preview.plan.summary, *preview.changes]).strip())
    req.dry_run = False
    show_change(call("launcher", method, req, timeout=timeout), dry_run=False)


def runs_on_substrate(ep: reg.Endpoint, req: Any) -> bool:
    """Whether the change starts or stops a job of ours (as start and stop, it is then confirmed first).

    An external pool never does; removing a server someone else runs (source external) neither.
    """
    if ep.launcher in ("", "external"):
        return False
    if isinstance(req, la.RemoveReplicaRequest):
        return any(req.replica in (r.id, r.base_url) and r.source != "external" for r in ep.replicas)
    return True


def show_change(resp: la.PoolChangeResponse, dry_run: bool) -> None:
    """Each change on its own line, then the pool as it is now (or, on a dry run, what would run)."""
    if Ctx.json:
        emit_json({"dry_run": dry_run, "changes": list(resp.changes), "endpoint": endpoint_dict(resp.endpoint),
                   "plan": message_dict(resp.plan)})
        return
    for line in resp.changes or ["nothing to change"]:
        console.print(escape(line), highlight=False)
    if dry_run:
        if resp.plan.script or resp.plan.manifest or resp.plan.commands or resp.plan.files:
            print_plan(resp.plan)
        console.print("(dry run: nothing was changed)", highlight=False)
        return
    ep = resp.endpoint
    console.print(f"endpoint [bold]{ep.name}[/]: {replicas_ready(ep) or '0/0'} replicas ready — {pool_line(ep)}",
                  highlight=False)
