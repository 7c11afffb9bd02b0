"""`make up` / `make down` / `make status`: the whole stack as background processes.

State lives in `.run/` of the checkout: one pid file per part it started, logs in `.run/logs/`,
Redis data in `.run/redis/`. `up` starts only what is down; `down` stops exactly what `up` started.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from examlops.svc import DEFAULT_ADMIN_KEY

from ._procs import grpc_serving, http_ok, pid_alive, spawn, stop_pid, wait_grpc, wait_http
from ._stack import SERVICES, StackPorts, service_argv, service_env

PARTS = ["redis", *SERVICES, "vllm"]
BOLD, DIM, GREEN, RED, RESET = "\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[0m"


def say(msg: str) -> None:
    sys.stderr.write(f"{BOLD}==>{RESET} {msg}\n")
    sys.stderr.flush()


@dataclass
class RunDir:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def pidfile(self, part: str) -> Path:
        return self.root / "pids" / f"{part}.pid"

    def pid(self, part: str) -> int | None:
        try:
            pid = int(self.pidfile(part).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def record(self, part: str, pid: int) -> None:
        self.pidfile(part).parent.mkdir(parents=True, exist_ok=True)
        self.pidfile(part).write_text(f"{pid}\n")

    def forget(self, part: str) -> None:
        self.pidfile(part).unlink(missing_ok=True)


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(part: str, ports: StackPorts) -> bool:
    if part == "redis":
        return _port_busy(ports.redis)
    if part == "gateway":
        return http_ok(ports.gateway_url + "/healthz")
    if part == "vllm":
        return http_ok(f"http://127.0.0.1:{ports.vllm}/health")
    return grpc_serving(ports.addr(part))


def start_redis(run: RunDir, ports: StackPorts) -> int:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is missing: `apt-get install redis-server` (make up does this as root)")
    data = run.root / "redis"
    data.mkdir(parents=True, exist_ok=True)
    # appendfsync always: a registration is acknowledged only once it is on disk.
    proc = spawn("redis", [exe, "--port", str(ports.redis), "--bind", "127.0.0.1", "--dir", str(data),
                           "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
                 {}, run.logs / "redis.log")
    deadline = time.monotonic() + 10
    while not _port_busy(ports.redis):
        if not proc.alive() or time.monotonic() > deadline:
            raise SystemExit(f"redis did not start:\n{proc.log_tail()}")
        time.sleep(0.02)
    return proc.pid


def start_vllm(run: RunDir, ports: StackPorts, vllm_venv: Path, model_dir: Path) -> int:
    from examlops.engine import find_model, render_vllm_command

    spec = find_model("smol")
    cmd = render_vllm_command(spec.engine, model=str(model_dir), host="127.0.0.1", port=ports.vllm)
    argv = [str(vllm_venv / "bin" / "vllm"), *cmd.argv[1:]]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           **cmd.env}
    (run.logs / "vllm.log").unlink(missing_ok=True)
    proc = spawn("vllm", argv, env, run.logs / "vllm.log")
    say(f"vLLM starting (pid {proc.pid}): {' '.join(cmd.argv)}")
    started = time.monotonic()
    last = ""
    while not http_ok(f"http://127.0.0.1:{ports.vllm}/health"):
        if not proc.alive():
            raise SystemExit(f"vLLM exited with {proc.popen.returncode}; last log lines:\n{proc.log_tail(40)}")
        line = _progress_line(proc.log_tail(5))
        if line and line != last:
            sys.stderr.write(f"   {DIM}[{time.monotonic() - started:5.0f}s] {line}{RESET}\n")
            last = line
        if time.monotonic() - started > 900:
            raise SystemExit(f"vLLM not healthy after 900 s; see {run.logs / 'vllm.log'}")
        time.sleep(1)
    say(f"vLLM healthy after {time.monotonic() - started:.0f} s")
    return proc.pid


def _progress_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        if " INFO " in line or "Loading" in line:
            return line.split("]", 1)[-1].strip()[:110]
    return ""


def up(run: RunDir, ports: StackPorts, engine: str, vllm_venv: Path | None, model_dir: Path | None) -> None:
    started = time.monotonic()
    for part in ["redis", *SERVICES]:
        pid = run.pid(part)
        if pid is not None and healthy(part, ports):
            say(f"{part}: already running (pid {pid})")
            continue
        if pid is None and healthy(part, ports):
            raise SystemExit(f"{part}: its port is taken by a process `make up` did not start; stop it first")
        if part == "redis":
            pid = start_redis(run, ports)
        else:
            proc = spawn(part, service_argv(part), service_env(part, ports), run.logs / f"{part}.log")
            if part == "gateway":
                wait_http(ports.gateway_url + "/healthz", 60, proc)
            else:
                wait_grpc(ports.addr(part), 60, proc)
            pid = proc.pid
        run.record(part, pid)
        say(f"{part}: started (pid {pid})")
    if engine == "vllm":
        if vllm_venv is None or model_dir is None:
            raise SystemExit("engine vllm needs --vllm-venv and --model-dir (make up passes them)")
        pid = run.pid("vllm")
        if pid is not None and healthy("vllm", ports):
            say(f"vllm: already running (pid {pid})")
        else:
            if pid is None and healthy("vllm", ports):
                raise SystemExit(f"port {ports.vllm} is taken by a process `make up` did not start; stop it first")
            run.record("vllm", start_vllm(run, ports, vllm_venv, model_dir))
    model = _register(ports, engine)
    answer, took = _first_answer(ports, model)
    say(f"stack up in {time.monotonic() - started:.0f} s; {model} answered through the gateway in {took:.2f} s: "
        f"{answer!r}")
    _usage(ports, model)


def _register(ports: StackPorts, engine: str) -> str:
    import grpc
    import orjson

    from examlops.launcher.v1 import launcher_pb2 as la
    from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc

    name = "smol" if engine == "vllm" else "echo"
    if engine == "vllm":
        from examlops.engine import find_model

        block = find_model("smol").engine.model_dump(mode="json", exclude_none=True)
        req = la.StartRequest(name=name, base_url=f"http://127.0.0.1:{ports.vllm}", launcher="external",
                              engine_block_json=orjson.dumps(block).decode(), actor="make-up", replace=True)
    else:
        req = la.StartRequest(name=name, launcher="external", engine_block_json='{"engine": "echo"}',
                              actor="make-up", replace=True)
    with grpc.insecure_channel(ports.addr("launcher")) as ch:
        resp = la_grpc.LauncherStub(ch).Start(req, timeout=30)
    say(f"endpoint {name}: registered, {resp.endpoint.state_reason}")
    return name


def _first_answer(ports: StackPorts, model: str) -> tuple[str, float]:
    import httpx

    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": model, "messages": question, "max_tokens": 24}
    deadline = time.monotonic() + 30
    while True:
        t0 = time.monotonic()
        resp = httpx.post(ports.gateway_url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"})
        if resp.status_code == 200:
            return str(resp.json()["choices"][0]["message"]["content"]).strip(), time.monotonic() - t0
        if time.monotonic() > deadline:  # the route appears within a second of registration
            raise SystemExit(f"the gateway did not answer for {model}: {resp.status_code} {resp.text}")
        time.sleep(0.2)


def _usage(ports: StackPorts, model: str) -> None:
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

  {exa} serve llm list
  {exa} serve llm chat {model} -m "Hello" --stream
  {exa} gateway chat {model} --message "Hello"

Logs: {Path('.run/logs').resolve()}/   status: make status   stop: make down
""")


def down(run: RunDir) -> None:
    for part in reversed(PARTS):
        pid = run.pid(part)
        if pid is None:
            run.forget(part)
            continue
        stop_pid(pid, timeout_s=20)
        run.forget(part)
        say(f"{part}: stopped (pid {pid})")


def status(run: RunDir, ports: StackPorts, as_json: bool) -> int:
    rows = []
    for part in PARTS:
        pid = run.pid(part)
        ok = healthy(part, ports)
        where = {"redis": ports.redis_url, "gateway": ports.gateway_url,
                 "vllm": f"http://127.0.0.1:{ports.vllm}"}.get(part) or ports.addr(part)
        rows.append({"part": part, "pid": pid, "healthy": ok, "address": where,
                     "log": str(run.logs / f"{part}.log")})
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        for r in rows:
            mark = f"{GREEN}up{RESET}  " if r["healthy"] else f"{RED}down{RESET}"
            sys.stdout.write(f"{r['part']:<13} {mark} pid {r['pid'] or '-':<8} {r['address']}\n")
    core = [r for r in rows if r["part"] != "vllm"]
    return 0 if all(r["healthy"] for r in core) else 1
