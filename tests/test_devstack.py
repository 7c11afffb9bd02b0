"""`make up` / `make status` / `make down` logic: idempotent start, exact stop (echo engine, shifted ports)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from examlops_devstack import StackPorts


def _free(ports: StackPorts) -> bool:
    for port in [ports.redis, ports.vllm, *ports.services.values()]:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


def _devstack(run_dir: Path, offset: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "examlops.devstack", "--run-dir", str(run_dir),
                           "--port-offset", str(offset), *args], capture_output=True, text=True, timeout=180)


def test_up_is_idempotent_and_down_stops_exactly_what_up_started(tmp_path: Path) -> None:
    offset = next(o for o in range(3000, 3300, 7) if _free(StackPorts.with_offset(o)))
    run = tmp_path / "run"
    try:
        first = _devstack(run, offset, "up", "--engine", "echo")
        assert first.returncode == 0, first.stderr
        assert "answered through the gateway" in first.stderr and "echo: What is the capital" in first.stderr
        assert "OpenAI(base_url=" in first.stdout
        status = json.loads(_devstack(run, offset, "status", "--json").stdout)
        up = {r["part"]: r for r in status}
        assert all(up[p]["healthy"] for p in up if p != "vllm") and not up["vllm"]["healthy"]
        pids = {p: r["pid"] for p, r in up.items() if p != "vllm"}

        again = _devstack(run, offset, "up", "--engine", "echo")
        assert again.returncode == 0, again.stderr
        assert again.stderr.count("already running") == 6
        assert {r["part"]: r["pid"] for r in json.loads(_devstack(run, offset, "status", "--json").stdout)
                if r["part"] != "vllm"} == pids
    finally:
        down = _devstack(run, offset, "down")
    assert down.returncode == 0
    assert down.stderr.count("stopped") == 6
    assert _devstack(run, offset, "status").returncode == 1
    assert not list((run / "pids").glob("*.pid"))
    assert (run / "logs" / "gateway.log").exists()
