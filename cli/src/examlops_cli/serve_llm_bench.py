"""`exa serve llm bench`: TTFT, inter-token latency and throughput of an endpoint under load.

Through the gateway by default (the numbers a client sees: gateway, engine-proxy and the server), or
with --direct straight to the endpoint's servers (its READY replicas, round-robin). How each number is
timed: _bench_load. vLLM's own view of the same requests, read from its /metrics around them, is
reported next to them: _bench_server.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Any

import grpc
import httpx
import orjson
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import ADDRESSLESS_ENGINES, state_name

from ._bench_load import FirstRequestFailed, LoadSpec, Run, Sample, Target, run_load, summarize
from ._bench_server import server_view
from ._output import Ctx, console, emit_json, err_console, fail, table
from ._rpc import rpc_fail, stub
from .gateway import error_line, unreachable_line
from .serve_llm import Model, app

#: The gateway's response cache must not answer a bench request (CACHE.md: both make the call a bypass).
_NO_CACHE = {"Cache-Control": "no-cache, no-store"}


@app.command()
def bench(
    model: Model,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 4,
    requests: Annotated[int, typer.Option(min=1, help="Measured requests.")] = 32,
    prompt_tokens: Annotated[int, typer.Option(
        min=1, help="Length of each synthetic prompt, in tokens (about: one common word per token, after "
                    "a head unique to the request; the chat template adds its own).")] = 256,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per request.")] = 128,
    warmup: Annotated[int, typer.Option(min=0, help="Requests sent first and not measured.")] = 2,
    direct: Annotated[bool, typer.Option(
        "--direct", help="Straight to the endpoint's servers (READY replicas, from the registry), not "
                         "through the gateway.")] = False,
    key: Annotated[str, typer.Option(
        help="Gateway key (a virtual key); default: the admin key (EXAMLOPS_ADMIN_KEY).")] = "",
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos/--stop-at-eos", help="Generate exactly --max-tokens (vLLM's ignore_eos), or stop "
                                           "where the model ends its answer.")] = True,
    timeout: Annotated[float, typer.Option(min=1, help="Longest wait for one request, in seconds.")] = 600.0,
    server_metrics: Annotated[bool, typer.Option(
        "--server-metrics/--no-server-metrics",
        help="Read the servers' own metrics (vLLM's /metrics) just before and after the measured requests "
             "and report vLLM's view of the same window next to the bench's.")] = True,
) -> None:
    """Load an endpoint with streamed chat requests and report TTFT, inter-token latency and throughput.

    --concurrency requests run at once until --requests have finished, after --warmup unmeasured ones.

    Reported: TTFT, inter-token latency, time per output token and request latency (mean, p50, p90,
    p99 in ms); output tokens/s and requests/s over the measured wall time. Output tokens are each
    stream's final usage (the server's own count). Every prompt is unique from its first token.

    Next to them, vLLM's own view of the same requests (its histograms' means over the run, read from
    its /metrics): its TTFT, and the same TTFT as its HTTP edge serves it, so the difference from the
    bench's TTFT is what lies between the client and the server (network, and the gateway with
    engine-proxy unless --direct).
    """
    if direct:
        (targets, servers), via, why_none = direct_targets(model), "direct", ""
    else:
        targets, via = gateway_targets(model, key)
        servers, why_none = gateway_servers(model) if server_metrics else ([], "")
    if not server_metrics:  # --direct found its servers as its targets: they are simply not read
        servers, why_none = [], "not read (--no-server-metrics)"
    spec = LoadSpec(targets=targets, concurrency=concurrency, requests=requests, warmup=warmup,
                    prompt_tokens=prompt_tokens, max_tokens=max_tokens, ignore_eos=ignore_eos, timeout_s=timeout,
                    servers=servers)
    try:
        result = run_with_progress(spec, model, via)
    except FirstRequestFailed as exc:
        fail(f"{model}: the first request failed, {exc} (nothing measured)")
    report = {"model": model, "via": via, "targets": [t.url for t in targets],
              "settings": {"concurrency": concurrency, "requests": requests, "warmup": warmup,
                           "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "ignore_eos": ignore_eos},
              **summarize(result.samples, result.wall_s)}
    report["server"] = (server_view(servers, result.before, result.after, report["completed"],
                                    report["output_tokens"]) if servers else {"servers": [], "error": why_none})
    if Ctx.json:
        emit_json(report)
    else:
        print_report(report)
    if not report["completed"]:
        fail(f"{model}: every request failed")


def gateway_targets(model: str, key: str) -> tuple[list[Target], str]:
    """The gateway's chat URL, after checking that it answers, takes the key and routes the model."""
    s = Ctx.settings()
    base = s.gateway_url.rstrip("/")
    secret = key or s.admin_key.get_secret_value()
    if not secret:
        fail("no gateway key: pass --key <virtual key> (`exa gateway key issue`) or set EXAMLOPS_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {secret}", "X-Examlops-Actor": Ctx.actor()}
    try:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=s.rpc_timeout_s)
    except httpx.HTTPError as exc:
        fail(unreachable_line(exc) + " (or bench the server itself: --direct)")
    if resp.status_code in (401, 403):
        which = "--key" if key else "the admin key (EXAMLOPS_ADMIN_KEY)"
        fail(f"the gateway refused {which}: {error_line(resp)}; pass --key <virtual key> allowed to use "
             f"{model} (`exa gateway key issue --model {model} ...`)")
    if resp.status_code != 200:
        fail(f"gateway {base}/v1/models: {error_line(resp)}")
    routed = sorted(m.get("id", "") for m in resp.json().get("data") or [])
    if model not in routed:
        fail(f"unknown model {model!r}: the gateway routes {', '.join(routed) or 'no model'} for this key "
             f"(`exa serve llm list` shows the endpoints; `exa serve llm start {model} ...` registers one)")
    return [Target(f"{base}/v1/chat/completions", {**headers, **_NO_CACHE}, model)], "gateway"


class NoServers(Exception):
    """Why an endpoint has no server a bench can reach directly, and (`hint`) what to do instead."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(reason)
        self.reason, self.hint = reason, hint


def ready_servers(model: str) -> tuple[reg.Endpoint, list[str]]:
    """The endpoint and the base URLs of its READY, non-draining replicas, as the registry records
    them (raises grpc.RpcError, NoServers)."""
    ep = stub("registry").GetEndpoint(reg.GetEndpointRequest(name=model), timeout=Ctx.settings().rpc_timeout_s)
    if ep.engine in ADDRESSLESS_ENGINES:
        raise NoServers(f"{model} runs inside engine-proxy (engine {ep.engine}): there is no server to reach",
                        "bench it through the gateway")
    pool = [(r.base_url, r.state, r.draining) for r in ep.replicas] or [(ep.base_url, ep.state, False)]
    urls = [url for url, state, draining in pool if url and state == reg.ENDPOINT_STATE_READY and not draining]
    if not urls:
        seen = ", ".join(f"{url or '(no address)'} {state_name(state)}" + (" draining" if d else "")
                         for url, state, d in pool)
        raise NoServers(f"{model} has no READY replica ({seen})", f"see `exa serve llm status {model}`")
    return ep, urls


def direct_targets(model: str) -> tuple[list[Target], list[str]]:
    """One target per READY, non-draining replica of the endpoint; (targets, their base URLs)."""
    try:
        ep, urls = ready_servers(model)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            fail(f"unknown model {model!r}: no endpoint of that name (`exa serve llm list` shows them; "
                 f"`exa serve llm start {model} ...` registers one)")
        rpc_fail("registry", exc)
    except NoServers as exc:
        fail(f"{exc.reason} for --direct: {exc.hint}")
    headers = dict(_NO_CACHE)
    block = orjson.loads(ep.engine_block_json) if ep.engine_block_json else {}
    ref = str(block.get("api_key_secret_ref") or "") if isinstance(block, dict) else ""
    if ref:
        var = ref.removeprefix("env:")
        if not os.environ.get(var):
            fail(f"{model}'s server wants an API key: set {var} (its api_key_secret_ref), or bench through "
                 "the gateway")
        headers["Authorization"] = f"Bearer {os.environ[var]}"
    served = ep.served_model_name or model
    return [Target(f"{url.rstrip('/')}/v1/chat/completions", headers, served) for url in urls], urls


def gateway_servers(model: str) -> tuple[list[str], str]:
    """The servers behind the gateway's route, for vLLM's own view of the run: (base URLs, or why none)."""
    try:
        return ready_servers(model)[1], ""
    except grpc.RpcError as exc:
        return [], f"the registry did not say where {model}'s servers are: {exc.details() or exc.code().name}"
    except NoServers as exc:
        return [], exc.reason


def run_with_progress(spec: LoadSpec, model: str, via: str) -> Run:
    """The load, with a progress bar on stderr (stdout keeps only the report)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn())
    with Progress(*columns, console=err_console) as progress:
        tasks = {"warmup": progress.add_task("warm-up", total=spec.warmup, failed=0)} if spec.warmup else {}
        tasks["bench"] = progress.add_task(f"bench {model} via {via}", total=spec.requests, failed=0)
        failed = dict.fromkeys(tasks, 0)

        def advance(phase: str, sample: Sample) -> None:
            failed[phase] += bool(sample.error)
            progress.update(tasks[phase], advance=1, failed=failed[phase])

        return asyncio.run(run_load(spec, advance))


def _ms(dist: dict[str, float] | None, key: str) -> str:
    return "-" if dist is None else f"{dist[key]:.1f}"


def print_report(r: dict[str, Any]) -> None:
    s = r["settings"]
    console.print(f"{r['model']} via {r['via']} ({', '.join(r['targets'])}): {s['requests']} requests, "
                  f"{s['concurrency']} at a time, prompt ~{s['prompt_tokens']} tokens "
                  f"({r['prompt_tokens_mean']:.0f} with the chat template), {s['max_tokens']} output tokens at most",
                  highlight=False)
    rows = [[name, *(_ms(r[key], q) for q in ("mean", "p50", "p90", "p99"))]
            for name, key in (("TTFT", "ttft_ms"), ("inter-token latency", "itl_ms"),
                              ("time per output token", "tpot_ms"), ("request latency", "latency_ms"))]
    table("Latency (ms)", ["", "mean", "p50", "p90", "p99"], rows)
    console.print(f"throughput: {r['output_tokens_per_s']:.1f} output tokens/s, {r['requests_per_s']:.2f} requests/s "
                  f"over {r['duration_s']:.2f} s ({r['output_tokens']} output tokens, {r['completed']} completed, "
                  f"{r['failed']} failed)", highlight=False)
    for e in r["errors"]:
        err_console.print(f"[yellow]{e['count']} failed:[/] {escape(e['error'])}", highlight=False)
    print_server_view(r)


def print_server_view(r: dict[str, Any]) -> None:
    """vLLM's view of the same requests, and what lies between it and the bench."""
    v = r["server"]
    if v.get("error"):
        err_console.print(f"vLLM's own metrics: {escape(v['error'])}", highlight=False)
        return
    if v["ttft_ms"] is None or r["ttft_ms"] is None:
        console.print("vLLM's own metrics: no request timed", highlight=False)
        return
    between = "the network and the client" + ("" if r["via"] == "direct" else ", the gateway and engine-proxy")
    edge = v["ttft_at_http_ms"]
    n = len(v["servers"])
    line = (f"vLLM's own metrics over the same requests ({n} server{'s' if n > 1 else ''}): TTFT mean "
            f"{v['ttft_ms']:.1f} ms by its engine clock")
    if edge is not None:
        line += (f", {edge:.1f} ms at its HTTP edge (+{v['http_extra_ms']:.1f} ms of HTTP handling); the bench's "
                 f"{r['ttft_ms']['mean']:.1f} ms adds {r['ttft_ms']['mean'] - edge:.1f} ms: {between}")
    if v["itl_ms"] is not None and r["itl_ms"] is not None:
        line += f"; inter-token latency mean {v['itl_ms']:.1f} ms (the bench's {r['itl_ms']['mean']:.1f})"
    console.print(line + f"; {v['output_tokens']} output tokens, {v['requests']} requests", highlight=False)
    if v["other_traffic"]:
        err_console.print("[yellow]other requests reached the server during the run:[/] vLLM's numbers include "
                          "them", highlight=False)
