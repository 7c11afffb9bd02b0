"""`make up` / `make down` / `make status`: the whole stack as background processes.

State lives in `.run/` of the checkout: one pid file per part it started, logs in `.run/logs/`,
Redis data in `.run/redis/` (the registry's) and `.run/gateway-redis/` (the gateway's), Prometheus'
configuration and data in `.run/prometheus/`. `up` starts only what is down; `down` stops exactly what `up` started.

Each part runs in its own session, so its pid is also its process group id, and every process of it
carries EXAMLOPS_RUN_DIR=<run dir> in its environment. A part is stopped as a whole group (vLLM's
engine core and workers with its API server), and a group whose leader died (an OOM kill of the
API server) is still found from its pid file and stopped: by `down`, or by the next `up` first.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from examlops.svc import DEFAULT_ADMIN_KEY, blocking_channel, tracing_config

from ._procs import Proc, grpc_serving, http_ok, spawn, wait_grpc, wait_http
from ._prometheus import start_prometheus
from ._rundir import BOLD, GREEN, RED, RESET, RunDir, say
from ._servers import ModelServer, model_servers, spawn_server, wait_servers
from ._stack import SERVICES, StackPorts, StackTokens, redis_argv, service_argv, service_env, stack_tokens

#: The vLLM servers of engine vllm: SmolLM2 (generation) and MiniLM (embeddings).
MODEL_PARTS = ["vllm", "minilm"]
#: Optional parts: `up` carries on without them, `status` does not fail for them.
EXTRA_PARTS = [*MODEL_PARTS, "prometheus"]
#: The registry's Redis acknowledges a write once it is fsynced (registrations, the audit trail); the
#: gateway's once it is written, fsynced within the second (GOVERNANCE.md, Durability).
REDIS_PARTS = {"redis": "always", "gateway-redis": "everysec"}
PARTS = [*REDIS_PARTS, *SERVICES, *EXTRA_PARTS]
__all__ = ["PARTS", "RunDir", "down", "status", "up"]


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(part: str, ports: StackPorts) -> bool:
    if part in REDIS_PARTS:
        return _port_busy(_redis_port(part, ports))
    if part == "gateway":
        return http_ok(ports.gateway_url + "/healthz")
    if part in MODEL_PARTS:
        return http_ok(f"http://127.0.0.1:{_model_port(part, ports)}/health")
    if part == "prometheus":
        return http_ok(ports.prometheus_url + "/-/ready")
    return grpc_serving(ports.addr(part))


def _model_port(part: str, ports: StackPorts) -> int:
    return ports.vllm if part == "vllm" else ports.minilm


def _redis_port(part: str, ports: StackPorts) -> int:
    return ports.gateway_redis_port if part == "gateway-redis" else ports.redis


def start_redis(run: RunDir, ports: StackPorts, part: str = "redis") -> Proc:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is missing: `apt-get install redis-server` (make up does this as root)")
    data = run.root / part
    data.mkdir(parents=True, exist_ok=True)
    port = _redis_port(part, ports)
    proc = spawn(part, redis_argv(exe, port, data, REDIS_PARTS[part]), run.env, run.logs / f"{part}.log")
    run.record(part, proc)
    deadline = time.monotonic() + 10
    while not _port_busy(port):
        if not proc.alive() or time.monotonic() > deadline:
            raise SystemExit(f"{part} did not start:\n{proc.log_tail()}")
        time.sleep(0.02)
    return proc


def start_model_servers(run: RunDir, servers: list[ModelServer], vllm_venv: Path) -> None:
    """Start every server that is down, all at once, then wait for them together."""
    started: list[tuple[ModelServer, Proc]] = []
    try:
        for server in servers:
            pid = run.pid(server.part)
            if http_ok(server.url + "/health"):
                if pid is None:
                    raise SystemExit(f"port {server.port} is taken by a process `make up` did not start; stop it first")
                say(f"{server.part}: already running (pid {pid})")
                continue
            started.append((server, spawn_server(run, server, vllm_venv)))
        wait_servers(run, started)
    except BaseException:
        for server, _ in started:
            run.stop(server.part)  # an API server that died leaves its engine core behind
        raise


def reap_leftovers(run: RunDir, ports: StackPorts) -> None:
    """Stop what a previous run left behind: groups whose leader died (members live on, e.g. vLLM's
    engine core holding the KV cache after its API server was killed) and leaders that stopped
    answering. A healthy part is kept."""
    for part in PARTS:
        pgid = run.recorded(part)
        if pgid is None:
            continue
        leader = run.pid(part) is not None
        if leader and healthy(part, ports):
            continue
        found = run.stop(part)
        if found and not leader:
            say(f"{part}: stopped {len(found)} leftover process(es) of a previous run whose leader {pgid} had died "
                f"(pids {' '.join(map(str, found))})")
        elif found:
            say(f"{part}: stopped the unhealthy previous run (pid {pgid})")


def up(run: RunDir, ports: StackPorts, engine: str, vllm_venv: Path | None, model_dir: Path | None,
       minilm_dir: Path | None = None) -> None:
    started = time.monotonic()
    reap_leftovers(run, ports)
    tokens = stack_tokens(run.root)  # generated once into .run/ (0600); exa finds its own there
    for part in [*REDIS_PARTS, *SERVICES]:
        pid = run.pid(part)
        if pid is not None and healthy(part, ports):
            say(f"{part}: already running (pid {pid})")
            continue
        if pid is None and healthy(part, ports):
            raise SystemExit(f"{part}: its port is taken by a process `make up` did not start; stop it first")
        try:
            if part in REDIS_PARTS:
                proc = start_redis(run, ports, part)
            else:
                env = {**service_env(part, ports, tokens=tokens), **ports.metrics_env(part), **run.env}
                proc = spawn(part, service_argv(part), env, run.logs / f"{part}.log")
                run.record(part, proc)
                if part == "gateway":
                    wait_http(ports.gateway_url + "/healthz", 60, proc)
                else:
                    wait_grpc(ports.addr(part), 60, proc)
        except BaseException:
            run.stop(part)
            raise
        run.record(part, proc)
        # EXAMLOPS_WORKERS of `make up`'s environment reaches every service; two of them use it
        workers = os.environ.get("EXAMLOPS_WORKERS", "1") if part in ("gateway", "engine-proxy") else "1"
        say(f"{part}: started (pid {proc.pid}{f', {workers} workers' if workers != '1' else ''})")
    say(f"services: {tracing_config().describe()}")
    if engine == "vllm":
        if vllm_venv is None or model_dir is None or minilm_dir is None:
            raise SystemExit("engine vllm needs --vllm-venv, --model-dir and --minilm-dir (make up passes them)")
        start_model_servers(run, model_servers(ports, model_dir, minilm_dir), vllm_venv)
    prometheus = start_prometheus(run, ports, engine)
    model = _register(ports, engine, tokens)
    answer, took = _first_answer(ports, model)
    say(f"stack up in {time.monotonic() - started:.0f} s; {model} answered through the gateway in {took:.2f} s: "
        f"{answer!r}")
    dimensions, took = _first_embedding(ports)
    say(f"{EMBEDDING_ROUTE} embedded through the gateway in {took:.2f} s: {dimensions} dimensions")
    _usage(ports, model, prometheus, run.logs)


#: The embedding route `make up` serves, and the route `exa rag query` generates on by default.
EMBEDDING_ROUTE, DEFAULT_ROUTE = "minilm", "default"


def _registrations(ports: StackPorts, engine: str) -> list[tuple[str, dict[str, object], str]]:
    """(name, engine block, base URL) of each endpoint: the chat model, `default` (the same server)
    and the embedding model. Engine echo stands in for both with no server at all."""
    if engine != "vllm":
        echo: dict[str, object] = {"engine": "echo"}
        embed: dict[str, object] = {"engine": "echo", "task": "embed", "served_model_name": EMBEDDING_ROUTE}
        return [("echo", echo, ""), (DEFAULT_ROUTE, echo, ""), (EMBEDDING_ROUTE, embed, "")]
    from examlops.engine import find_model

    smol = find_model("smol").engine.model_dump(mode="json", exclude_none=True)
    minilm = find_model("minilm").engine.model_dump(mode="json", exclude_none=True)
    chat_url, embed_url = f"http://127.0.0.1:{ports.vllm}", f"http://127.0.0.1:{ports.minilm}"
    return [("smol", smol, chat_url), (DEFAULT_ROUTE, smol, chat_url), (EMBEDDING_ROUTE, minilm, embed_url)]


def _register(ports: StackPorts, engine: str, tokens: StackTokens) -> str:
    """Register every endpoint through the external launcher; returns the chat model's name."""
    import orjson

    from examlops.launcher.v1 import launcher_pb2 as la
    from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc

    registrations = _registrations(ports, engine)
    with blocking_channel(ports.addr("launcher"), tokens.operator_token) as ch:
        for name, block, base_url in registrations:
            req = la.StartRequest(name=name, base_url=base_url, launcher="external", actor="make-up", replace=True,
                                  engine_block_json=orjson.dumps(block).decode())
            resp = la_grpc.LauncherStub(ch).Start(req, timeout=30)
            say(f"endpoint {name}: registered, {resp.endpoint.state_reason}")
    return registrations[0][0]


def _gateway_post(ports: StackPorts, path: str, body: dict[str, object]) -> tuple[dict[str, object], float]:
    """POST until the route answers (it appears within a second of registration); the answer and its time."""
    import httpx

    deadline = time.monotonic() + 30
    while True:
        t0 = time.monotonic()
        resp = httpx.post(ports.gateway_url + path, json=body, timeout=120,
                          headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"})
        if resp.status_code == 200:
            answer: dict[str, object] = resp.json()
            return answer, time.monotonic() - t0
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not answer {path} for {body['model']}: {resp.status_code} {resp.text}")
        time.sleep(0.2)


def _first_answer(ports: StackPorts, model: str) -> tuple[str, float]:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer, took = _gateway_post(ports, "/v1/chat/completions",
                                 {"model": model, "messages": question, "max_tokens": 24})
    return str(answer["choices"][0]["message"]["content"]).strip(), took  # type: ignore[index]


def _first_embedding(ports: StackPorts) -> tuple[int, float]:
    answer, took = _gateway_post(ports, "/v1/embeddings", {"model": EMBEDDING_ROUTE, "input": "Hello!"})
    return len(answer["data"][0]["embedding"]), took  # type: ignore[index]


def _usage(ports: StackPorts, model: str, prometheus: str | None, logs: Path) -> None:
    url, key = ports.gateway_url, DEFAULT_ADMIN_KEY
    exa = Path(sys.executable).parent / "exa"
    on_path = shutil.which("exa")
    if on_path and Path(on_path).resolve() == exa.resolve():
        exa = Path("exa")
    sys.stdout.write(f"""
{BOLD}ExaMLOps is up.{RESET}  Gateway {url}/v1   key {key}   model {model}

  curl -s {url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\
       -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{key}")
  print(client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)

  # Embeddings ({EMBEDDING_ROUTE}: all-MiniLM-L6-v2, 384 dimensions), by curl or the client above;
  # route {DEFAULT_ROUTE} is {model} again (exa rag query generates on it)
  curl -s {url}/v1/embeddings -H 'Authorization: Bearer {key}' \\
       -H 'Content-Type: application/json' -d '{{"model": "{EMBEDDING_ROUTE}", "input": ["Hello!"]}}'
  print(len(client.embeddings.create(model="{EMBEDDING_ROUTE}", input="Hello!").data[0].embedding))

  {exa} serve llm list
  {exa} serve llm chat {model} -m "Hello" --stream
  {exa} gateway chat {model} --message "Hello"

{_prometheus_line(prometheus)}
Logs: {logs}/   status: make status   stop: make down
""")


def _prometheus_line(url: str | None) -> str:
    if url is None:
        return "Prometheus: not installed (apt-get install prometheus), so no metrics or alerts"
    return f"Prometheus {url}  (alerts: {url}/alerts, targets: {url}/targets; rules: observability/prometheus/)"


def down(run: RunDir) -> None:
    for part in reversed(PARTS):
        pgid, leader = run.recorded(part), run.pid(part) is not None
        found = run.stop(part)
        if found and leader:
            say(f"{part}: stopped (pid {pgid}, {len(found)} process(es))")
        elif found:
            say(f"{part}: stopped {len(found)} leftover process(es) whose leader {pgid} had died "
                f"(pids {' '.join(map(str, found))})")
        elif leader:
            say(f"{part}: pid {pgid} is alive but not marked {run.marker}: not ours, left alone")
    (run.root / "port-offset").unlink(missing_ok=True)


def status(run: RunDir, ports: StackPorts, as_json: bool) -> int:
    rows = []
    for part in PARTS:
        pid = run.pid(part)
        ok = healthy(part, ports)
        where = {"redis": ports.redis_url, "gateway-redis": ports.gateway_redis_url, "gateway": ports.gateway_url,
                 "vllm": f"http://127.0.0.1:{ports.vllm}", "minilm": f"http://127.0.0.1:{ports.minilm}",
                 "prometheus": ports.prometheus_url}.get(part) \
            or ports.addr(part)
        rows.append({"part": part, "pid": pid, "healthy": ok, "address": where,
                     "log": str(run.logs / f"{part}.log")})
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        for r in rows:
            mark = f"{GREEN}up{RESET}  " if r["healthy"] else f"{RED}down{RESET}"
            sys.stdout.write(f"{r['part']:<13} {mark} pid {r['pid'] or '-':<8} {r['address']}\n")
    core = [r for r in rows if r["part"] not in EXTRA_PARTS]
    return 0 if all(r["healthy"] for r in core) else 1
