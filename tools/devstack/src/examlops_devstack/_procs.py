"""Process helpers: spawn in its own session, wait until healthy, stop the whole group."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: Ports `free_port` handed out in this process: never handed out twice, even before their owner binds.
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port from bind(("", 0)) is in
    that range, so any outgoing connection made before its owner binds (a service dialing Redis) can
    take it and the owner then fails with EADDRINUSE. Below the range only another listener competes."""
    low = max(_ephemeral_low(), 20000)
    for _ in range(1000):
        port = random.randrange(15000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port found in 15000-{low}")


#: Set in the environment of every process `spawn` starts and inherited by its children: one way a
#: member of a group is told apart from a stranger that reuses its numbers. Not the only way:
#: setproctitle (Redis, vLLM's EngineCore) wipes /proc/<pid>/environ, hence the snapshots below.
SPAWN_ID_ENV = "EXAMLOPS_SPAWN_ID"
#: The run directory of `make up` (python -m examlops_devstack): marks the processes it started.
RUN_DIR_ENV = "EXAMLOPS_RUN_DIR"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    marker: str = ""
    #: pid -> start time of the members seen while the leader was unreaped (see remember_group).
    known: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The leader's pid, which is also its process group and session id (its own session)."""
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def remember_group(self) -> None:
        """Note the group's current members. While the leader is not reaped its pid cannot be reused,
        so every process of its group is ours; after that only remembered or marked ones are."""
        if self.popen.returncode is None:
            self.known.update(group_snapshot(self.pid))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        """Stop the whole group, the leader's children included even when the leader already died."""
        self.remember_group()
        stop_group(self.pid, self.marker, self.known, sig, timeout_s)
        try:
            self.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def spawn(name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
          cwd: Path | None = None) -> Proc:
    """Start `argv` in its own session and process group, stdout+stderr appended to `log_path`.

    Its processes are marked by `env`'s EXAMLOPS_RUN_DIR when given (so a later run can recognise
    them from a pid file), else by a fresh EXAMLOPS_SPAWN_ID.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, SPAWN_ID_ENV: uuid.uuid4().hex, **env}
    marker_key = RUN_DIR_ENV if RUN_DIR_ENV in env else SPAWN_ID_ENV
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=full_env, cwd=cwd, start_new_session=True)
    return Proc(name, popen, log_path, f"{marker_key}={full_env[marker_key]}")


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


def _stat(pid: int | str) -> tuple[int, int, int] | None:
    """(process group, session, start time in clock ticks) of a live process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[2]), int(fields[3]), int(fields[19])


def start_time(pid: int) -> int | None:
    """The start time of a live process: with its pid, an identity no later process can take."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def group_snapshot(pgid: int) -> dict[int, int]:
    """pid -> start time of every live process in the process group or session `pgid`.

    Trust it only while the leader `pgid` is alive or an unreaped child of the caller: the kernel
    does not reuse a pid that is still a group or session id, so then every member descends from it.
    """
    members = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None and pgid in stat[:2]:
            members[int(entry.name)] = stat[2]
    return members


def group_members(pgid: int, marker: str, known: Mapping[int, int] | None = None) -> list[int]:
    """Live processes of the group or session `pgid` that are ours: their environment holds
    `marker` ("KEY=value" as spawn set it), or their pid and start time are in `known`.

    A group whose leader died keeps its id, and vLLM's engine core and workers stay in it; the
    checks keep a number reused since from matching a stranger.
    """
    members = []
    for pid, started in group_snapshot(pgid).items():
        if known and known.get(pid) == started:
            members.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker and marker.encode() in f.read().split(b"\0"):
                    members.append(pid)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return sorted(members)


def stop_group(pgid: int, marker: str, known: Mapping[int, int] | None = None, sig: int = signal.SIGTERM,
               timeout_s: float = 15.0) -> list[int]:
    """Signal every member of the group `pgid` that is ours (see group_members), SIGKILL what is
    left after `timeout_s`; returns the pids it found. Never signals the group id as a whole."""
    found = group_members(pgid, marker, known)
    _signal_each(found, sig)
    deadline = time.monotonic() + timeout_s
    while (left := group_members(pgid, marker, known)) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_each(left, signal.SIGKILL)
    while group_members(pgid, marker, known) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    return found


def _signal_each(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
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
