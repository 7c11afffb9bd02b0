"""The CPU vLLM servers of `make up`: SmolLM2 (generation) and all-MiniLM-L6-v2 (embeddings).

Both are rendered from their use-case pack blocks (`smol`, `minilm`) by the one renderer, started
together and then waited for together, so the embedding model adds little to `make up`'s time.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ._procs import Proc, http_ok, spawn
from ._rundir import DIM, RESET, RunDir, say
from ._stack import StackPorts

HEALTHY_WITHIN_S = 900


@dataclass(frozen=True)
class ModelServer:
    """One `vllm serve` of the stack: its part name (pid file, log, status row) and pack model."""

    part: str
    pack_model: str
    port: int
    model_dir: Path
    kv_cache_gb: str  # VLLM_CPU_KVCACHE_SPACE unless the environment sets it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def model_servers(ports: StackPorts, smol_dir: Path, minilm_dir: Path) -> list[ModelServer]:
    return [ModelServer("vllm", "smol", ports.vllm, smol_dir, "2"),
            ModelServer("minilm", "minilm", ports.minilm, minilm_dir, "1")]


def spawn_server(run: RunDir, server: ModelServer, vllm_venv: Path) -> Proc:
    from examlops.engine import find_model, render_vllm_command

    block = find_model(server.pack_model).engine
    cmd = render_vllm_command(block, model=str(server.model_dir), host="127.0.0.1", port=server.port)
    argv = [str(vllm_venv / "bin" / "vllm"), *cmd.argv[1:]]
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", server.kv_cache_gb)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": kv_cache, **cmd.env, **run.env}
    log = run.logs / f"{server.part}.log"
    log.unlink(missing_ok=True)
    proc = spawn(server.part, argv, env, log)
    run.record(server.part, proc)
    say(f"{server.part} starting (pid {proc.pid}): {' '.join(cmd.argv)}")
    return proc


def wait_servers(run: RunDir, started: list[tuple[ModelServer, Proc]]) -> None:
    """Wait until every started server answers /health; SystemExit naming the first that fails."""
    began = time.monotonic()
    waiting = dict(started)
    last: dict[str, str] = {}
    while waiting:
        for server, proc in list(waiting.items()):
            run.record(server.part, proc)  # its engine core and workers as they appear, for `down` after a crash
            if http_ok(server.url + "/health"):
                del waiting[server]
                say(f"{server.part} healthy after {time.monotonic() - began:.0f} s")
                continue
            if not proc.alive():
                raise SystemExit(f"{server.part} (vLLM) exited with {proc.popen.returncode}; last log lines:\n"
                                 f"{proc.log_tail(40)}")
            line = _progress_line(proc.log_tail(5))
            if line and line != last.get(server.part):
                sys.stderr.write(f"   {DIM}[{time.monotonic() - began:5.0f}s] {server.part}: {line}{RESET}\n")
                last[server.part] = line
        if waiting and time.monotonic() - began > HEALTHY_WITHIN_S:
            names = ", ".join(s.part for s in waiting)
            raise SystemExit(f"{names} not healthy after {HEALTHY_WITHIN_S} s; see {run.logs}/")
        if waiting:
            time.sleep(1)
    for server, proc in started:
        run.record(server.part, proc)


def _progress_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        if " INFO " in line or "Loading" in line:
            return line.split("]", 1)[-1].strip()[:100]
    return ""
