"""`make up` / `make down` / `make status`: the whole stack as background processes.

State lives in `.run/` of the checkout: one pid file per part it started, logs in `.run/logs/`,
Redis data in `.run/redis/`. `up` starts only what is down; `down` stops exactly what `up` started.

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
from dataclasses import dataclass
from pathlib import Path

from examlops.svc import DEFAULT_ADMIN_KEY, blocking_channel

from ._procs import (
    RUN_DIR_ENV,
    Proc,
    group_members,
    grpc_serving,
    http_ok,
    spawn,
    start_time,
    stop_group,
    wait_grpc,
    wait_http,
)
from ._stack import SERVICES, StackPorts, StackTokens, service_argv, service_env, stack_tokens

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

    @property
    def env(self) -> dict[str, str]:
        """Set on every process `up` starts: how `down` knows a member of a recorded group is ours."""
        return {RUN_DIR_ENV: str(self.root)}

    @property
    def marker(self) -> str:
        return f"{RUN_DIR_ENV}={self.root}"

    def _lines(self, part: str) -> list[list[int]]:
        try:
            return [[int(v) for v in line.split()] for line in self.pidfile(part).read_text().splitlines()]
        except (OSError, ValueError):
            return []

    def recorded(self, part: str) -> int | None:
        """The recorded leader pid (= process group and session id) of `part`, alive or not."""
        lines = self._lines(part)
        return lines[0][0] if lines and lines[0] else None

    def known(self, part: str) -> dict[int, int]:
        """pid -> start time of the members of `part` seen while its leader was alive."""
        return {line[0]: line[1] for line in self._lines(part)[1:] if len(line) == 2}

    def pid(self, part: str) -> int | None:
        """The leader pid of `part` when that very leader (same pid, same start time) is alive."""
        pid = self.recorded(part)
        if pid is None or start_time(pid) is None or start_time(pid) != self.known(part).get(pid):
            return None
        return pid

    def record(self, part: str, proc: Proc) -> None:
        """Write the part's pid file: its leader, then pid and start time of each member seen so far
        (vLLM's engine core wipes its environment, so the marker alone cannot find it later)."""
        proc.remember_group()
        known = {**self.known(part), **proc.known} if self.recorded(part) == proc.pid else proc.known
        self.pidfile(part).parent.mkdir(parents=True, exist_ok=True)
        self.pidfile(part).write_text("".join([f"{proc.pid}\n", *(f"{p} {t}\n" for p, t in sorted(known.items()))]))

    def stop(self, part: str) -> list[int]:
        """Stop every process of the part's group that is ours; forget the part once none is left."""
        pgid = self.recorded(part)
        if pgid is None:
            return []
        found = stop_group(pgid, self.marker, self.known(part), timeout_s=20)
        if left := group_members(pgid, self.marker, self.known(part)):
            say(f"{RED}{part}: pids {' '.join(map(str, left))} survived SIGKILL; {self.pidfile(part)} kept{RESET}")
        else:
            self.forget(part)
        return found

    def forget(self, part: str) -> None:
        self.pidfile(part).unlink(missing_ok=True)

    def port_offset(self) -> int:
        """The port offset of the stack this run dir holds (0 when none): the CLI reads the same file
        (examlops_cli._config.PORT_OFFSET_FILE) to find the running stack."""
        try:
            return int((self.root / "port-offset").read_text().strip())
        except (OSError, ValueError):
            return 0

    def record_port_offset(self, offset: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "port-offset").write_text(f"{offset}\n")


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


def start_redis(run: RunDir, ports: StackPorts) -> Proc:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is missing: `apt-get install redis-server` (make up does this as root)")
    data = run.root / "redis"
    data.mkdir(parents=True, exist_ok=True)
    # appendfsync always: a registration is acknowledged only once it is on disk.
    proc = spawn("redis", [exe, "--port", str(ports.redis), "--bind", "127.0.0.1", "--dir", str(data),
                           "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
                 run.env, run.logs / "redis.log")
    run.record("redis", proc)
    deadline = time.monotonic() + 10
    while not _port_busy(ports.redis):
        if not proc.alive() or time.monotonic() > deadline:
            raise SystemExit(f"redis did not start:\n{proc.log_tail()}")
        time.sleep(0.02)
    return proc


def start_vllm(run: RunDir, ports: StackPorts, vllm_venv: Path, model_dir: Path) -> Proc:
    from examlops.engine import find_model, render_vllm_command

    spec = find_model("smol")
    cmd = render_vllm_command(spec.engine, model=str(model_dir), host="127.0.0.1", port=ports.vllm)
    argv = [str(vllm_venv / "bin" / "vllm"), *cmd.argv[1:]]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           **cmd.env, **run.env}
    (run.logs / "vllm.log").unlink(missing_ok=True)
    proc = spawn("vllm", argv, env, run.logs / "vllm.log")
    say(f"vLLM starting (pid {proc.pid}): {' '.join(cmd.argv)}")
    started = time.monotonic()
    last = ""
    while not http_ok(f"http://127.0.0.1:{ports.vllm}/health"):
        run.record("vllm", proc)  # its engine core and workers as they appear, for `down` after a crash
        if not proc.alive():
            raise SystemExit(f"vLLM exited with {proc.popen.returncode}; last log lines:\n{proc.log_tail(40)}")
        line = _progress_line(proc.log_tail(5))
        if line and line != last:
            sys.stderr.write(f"   {DIM}[{time.monotonic() - started:5.0f}s] {line}{RESET}\n")
            last = line
        if time.monotonic() - started > 900:
            raise SystemExit(f"vLLM not healthy after 900 s; see {run.logs / 'vllm.log'}")
        time.sleep(1)
    run.record("vllm", proc)
    say(f"vLLM healthy after {time.monotonic() - started:.0f} s")
    return proc


def _progress_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        if " INFO " in line or "Loading" in line:
            return line.split("]", 1)[-1].strip()[:110]
    return ""


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


def up(run: RunDir, ports: StackPorts, engine: str, vllm_venv: Path | None, model_dir: Path | None) -> None:
    started = time.monotonic()
    reap_leftovers(run, ports)
    tokens = stack_tokens(run.root)  # generated once into .run/ (0600); exa finds its own there
    for part in ["redis", *SERVICES]:
        pid = run.pid(part)
        if pid is not None and healthy(part, ports):
            say(f"{part}: already running (pid {pid})")
            continue
        if pid is None and healthy(part, ports):
            raise SystemExit(f"{part}: its port is taken by a process `make up` did not start; stop it first")
        try:
            if part == "redis":
                proc = start_redis(run, ports)
            else:
                proc = spawn(part, service_argv(part), {**service_env(part, ports, tokens=tokens), **run.env},
                             run.logs / f"{part}.log")
                run.record(part, proc)
                if part == "gateway":
                    wait_http(ports.gateway_url + "/healthz", 60, proc)
                else:
                    wait_grpc(ports.addr(part), 60, proc)
        except BaseException:
            run.stop(part)
            raise
        run.record(part, proc)
        say(f"{part}: started (pid {proc.pid})")
    if engine == "vllm":
        if vllm_venv is None or model_dir is None:
            raise SystemExit("engine vllm needs --vllm-venv and --model-dir (make up passes them)")
        pid = run.pid("vllm")
        if pid is not None and healthy("vllm", ports):
            say(f"vllm: already running (pid {pid})")
        else:
            if pid is None and healthy("vllm", ports):
                raise SystemExit(f"port {ports.vllm} is taken by a process `make up` did not start; stop it first")
            try:
                start_vllm(run, ports, vllm_venv, model_dir)
            except BaseException:
                run.stop("vllm")  # an API server that died leaves its engine core behind
                raise
    model = _register(ports, engine, tokens)
    answer, took = _first_answer(ports, model)
    say(f"stack up in {time.monotonic() - started:.0f} s; {model} answered through the gateway in {took:.2f} s: "
        f"{answer!r}")
    _usage(ports, model)


def _register(ports: StackPorts, engine: str, tokens: StackTokens) -> str:
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
    with blocking_channel(ports.addr("launcher"), tokens.operator_token) as ch:
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
