"""The peers `bench_peers.py` starts beside our stack, how it pins processes, and what it records of the machine.

- the plain pass-through proxy (bench/plain_proxy.py) in front of the stub;
- LiteLLM's proxy from its own virtual environment (scripts/litellm-env.sh builds it), started
  offline, without database or Redis, with everything we do not compare turned off;
- `taskset` pinning of a process with all its threads and descendants;
- the machine's description for the results file.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from examlops_devstack import Proc, free_port, spawn, wait_http

BENCH = Path(__file__).resolve().parent
LITELLM_VERSION = "1.110.2"
LITELLM_MASTER_KEY = "sk-bench-peers-master"


def default_litellm_venv() -> Path:
    cache = Path(os.environ.get("EXAMLOPS_CACHE_DIR") or
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "examlops")
    return cache / f"litellm-{LITELLM_VERSION}"


def start_plain_proxy(upstream: str, log: Path) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn("plain-proxy", [sys.executable, str(BENCH / "plain_proxy.py"), "--port", str(port),
                                 "--upstream", upstream], {}, log)
    return _ready(proc, f"http://127.0.0.1:{port}", "/health", 30)


def _ready(proc: Proc, url: str, probe: str, timeout_s: float) -> tuple[Proc, str]:
    """`proc` once `url + probe` answers 200; stopped when it does not within `timeout_s`."""
    try:
        wait_http(url + probe, timeout_s, proc)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def litellm_config(model: str, stub_url: str) -> dict[str, Any]:
    """`model` routed to the stub, and off what we do not compare (retries, cache, callbacks, cooldowns,
    spend and error logs, background health checks, telemetry)."""
    return {
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": stub_url + "/v1", "api_key": "x"}}],
        "litellm_settings": {"drop_params": True, "num_retries": 0, "cache": False, "callbacks": [],
                             "success_callback": [], "failure_callback": [], "telemetry": False},
        "router_settings": {"disable_cooldowns": True, "num_retries": 0},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY", "disable_spend_logs": True,
                             "disable_error_logs": True, "background_health_checks": False},
    }


def start_litellm(venv: Path, model: str, stub_url: str, workdir: Path) -> tuple[Proc, str]:
    """LiteLLM's proxy, one worker, ready once /health/liveliness answers."""
    exe = venv / "bin" / "litellm"
    if not exe.exists():
        raise RuntimeError(f"no LiteLLM in {venv} (bash scripts/litellm-env.sh installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "litellm.yaml"
    config.write_text(json.dumps(litellm_config(model, stub_url), indent=2))  # JSON is YAML
    port = free_port()
    # no DATABASE_URL / REDIS_* in its environment: no database, no Redis
    for name in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL"):
        if os.environ.get(name):
            raise RuntimeError(f"{name} is set: LiteLLM would use it; unset it for this benchmark")
    env = {"LITELLM_OFFLINE_MODE": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_MASTER_KEY": LITELLM_MASTER_KEY}
    proc = spawn("litellm", [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env, workdir / "litellm.log", cwd=workdir)
    return _ready(proc, f"http://127.0.0.1:{port}", "/health/liveliness", 180)


def litellm_version(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or "unknown"


# ---------------------------------------------------------------------------------------------
# Pinning


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (uvicorn's workers, LiteLLM's children), from /proc's children lists."""
    seen: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split() if int(c) not in seen]
            except OSError:
                continue
    return seen


def pin(pid: int, cpu: int) -> list[int]:
    """`taskset -a -p -c cpu` on `pid` and each descendant: every thread of the tree on `cpu`.
    Raises RuntimeError when taskset refuses (a results file must not say pinned when it was not)."""
    tree = process_tree(pid)
    for p in tree:
        done = subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(p)], capture_output=True, text=True)
        if done.returncode != 0 and os.path.exists(f"/proc/{p}"):  # a process that ended has nothing to pin
            raise RuntimeError(f"taskset could not pin process {p} to CPU {cpu}: {done.stderr.strip()}")
    return tree


def pin_cpus() -> tuple[int, int] | None:
    """The two CPUs to pin on (the proxy's, the rest's): the first two this process may use; None
    without taskset or with fewer than two."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if shutil.which("taskset") is not None and len(cpus) >= 2 else None


# ---------------------------------------------------------------------------------------------
# The machine


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return float("nan")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    out = subprocess.run(["git", "-C", str(BENCH.parent), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def machine_description(litellm: str, pinning: dict[str, str], extra: dict[str, str]) -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpu_model": _lscpu_model(), "cpus": os.cpu_count(),
            "memory_gib": _mem_gib(), "kernel": platform.release(), "python": platform.python_version(),
            "commit": _git_commit(),
            "versions": {"examlops-gateway": _version("examlops-gateway"), "litellm": litellm,
                         "httpx": _version("httpx"), "uvicorn": _version("uvicorn"),
                         "starlette": _version("starlette")},
            "pinning": pinning, **extra}
