"""`exa serve llm bench`: TTFT, inter-token latency and throughput of an endpoint under load.

Through the gateway by default (the numbers a client sees: gateway, engine-proxy and the server), or
with --direct straight to the endpoint's servers (its READY replicas, round-robin), which is what
vLLM's own histograms measure plus the HTTP hop. How each number is timed: _bench_load.
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

from ._bench_load import FirstRequestFailed, LoadSpec, Sample, Target, run_load, summarize
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
) -> None:
    """Load an endpoint with streamed chat requests and report TTFT, inter-token latency and throughput.

    --concurrency requests run at once until --requests have finished, after --warmup unmeasured ones.

    Reported: TTFT, inter-token latency, time per output token and request latency (mean, p50, p90,
    p99 in ms); output tokens/s and requests/s over the measured wall time. Output tokens are each
    stream's final usage (the server's own count). Every prompt is unique from its first token.
    """
    targets, via = direct_targets(model) if direct else gateway_targets(model, key)
    spec = LoadSpec(targets=targets, concurrency=concurrency, requests=requests, warmup=warmup,
                    prompt_tokens=prompt_tokens, max_tokens=max_tokens, ignore_eos=ignore_eos, timeout_s=timeout)
    try:
        samples, wall_s = run_with_progress(spec, model, via)
    except FirstRequestFailed as exc:
        fail(f"{model}: the first request failed, {exc} (nothing measured)")
    report = {"model": model, "via": via, "targets": [t.url for t in targets],
              "settings": {"concurrency": concurrency, "requests": requests, "warmup": warmup,
                           "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "ignore_eos": ignore_eos},
              **summarize(samples, wall_s)}
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


def direct_targets(model: str) -> tuple[list[Target], str]:
    """One target per READY, non-draining replica of the endpoint, as the registry records it."""
    try:
        ep = stub("registry").GetEndpoint(reg.GetEndpointRequest(name=model), timeout=Ctx.settings().rpc_timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            fail(f"unknown model {model!r}: no endpoint of that name (`exa serve llm list` shows them; "
                 f"`exa serve llm start {model} ...` registers one)")
        rpc_fail("registry", exc)
    if ep.engine in ADDRESSLESS_ENGINES:
        fail(f"{model} runs inside engine-proxy (engine {ep.engine}): there is no server to reach with "
             "--direct; bench it through the gateway")
    pool = [(r.base_url, r.state, r.draining) for r in ep.replicas] or [(ep.base_url, ep.state, False)]
    urls = [url for url, state, draining in pool if url and state == reg.ENDPOINT_STATE_READY and not draining]
    if not urls:
        seen = ", ".join(f"{url or '(no address)'} {state_name(state)}" + (" draining" if d else "")
                         for url, state, d in pool)
        fail(f"{model} has no READY replica to bench ({seen}): see `exa serve llm status {model}`")
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
    return [Target(f"{url.rstrip('/')}/v1/chat/completions", headers, served) for url in urls], "direct"


def run_with_progress(spec: LoadSpec, model: str, via: str) -> tuple[list[Sample], float]:
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
