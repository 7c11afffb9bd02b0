"""Worker processes as tests see them through /proc: a parent's workers, and which of them holds a
connection on a port."""

from __future__ import annotations

import os
from pathlib import Path

from examlops_devstack import Proc, service_argv, spawn
from examlops_testsupport.fixtures import Stack


def children(pid: int) -> set[int]:
    """The live worker processes whose parent is `pid` (not multiprocessing's resource tracker)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            out.add(int(stat.parent.name))
    return out


def holding_connection(pids: set[int], port: int) -> set[int]:
    """Which of `pids` hold an established TCP connection whose local port is `port` (an accepted one)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
                inodes.add(f"socket:[{fields[9]}]")
    holders = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    holders.add(pid)
            except OSError:
                continue
    return holders


def start_engine_proxy(stack: Stack, name: str, port: int, metrics_port: int, workers: int = 2) -> Proc:
    """Another engine-proxy of `stack` on `port`, as `workers` worker processes (not waited for)."""
    env = {**stack.env("engine-proxy"), "EXAMLOPS_WORKERS": str(workers), "EXAMLOPS_PORT": str(port),
           "EXAMLOPS_METRICS_PORT": str(metrics_port)}
    return spawn(name, service_argv("engine-proxy"), env, stack.workdir / f"{name}.log")
