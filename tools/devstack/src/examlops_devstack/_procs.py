"""Process helpers: spawn in its own session, wait until healthy, stop the whole group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        if self.alive():
            stop_pid(self.pid, sig, timeout_s)
        try:
            self.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def spawn(name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
          cwd: Path | None = None) -> Proc:
    """Start `argv` detached in its own process group, stdout+stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **env}, cwd=cwd, start_new_session=True)
    return Proc(name, popen, log_path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def stop_pid(pid: int, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Signal the process group of `pid`, escalate to SIGKILL after `timeout_s`."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait(check: Callable[[], bool], what: str, timeout_s: float, proc: Proc | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before {what}:\n{proc.log_tail()}")
        if check():
            return
        time.sleep(0.05)
    tail = f":\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"{what} not reached within {timeout_s:.0f}s{tail}")


def grpc_serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_grpc(addr: str, timeout_s: float = 30, proc: Proc | None = None) -> None:
    _wait(lambda: grpc_serving(addr), f"gRPC health SERVING at {addr}", timeout_s, proc)


def wait_http(url: str, timeout_s: float = 30, proc: Proc | None = None) -> None:
    _wait(lambda: http_ok(url), f"HTTP 200 from {url}", timeout_s, proc)
