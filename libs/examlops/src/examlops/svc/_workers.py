"""Several worker processes of one gRPC service on one port (EXAMLOPS_WORKERS > 1).

The parent checks the port, starts the workers (each a whole server that binds the port with
SO_REUSEPORT, so the kernel spreads new connections over them), serves the merged metrics once,
and waits. SIGTERM or SIGINT is passed on to every worker, which drains its calls as a single
server does. A worker that exits before it is serving stops the service (exit 1: it would fail
again, e.g. a bad setting or a port taken); a worker that dies later is replaced by a new one
(its counters stay in the sums). A worker whose parent is gone (SIGKILL) stops itself within a
second, so no orphan keeps the port.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from ._metrics import multiprocess_metrics, serve_metrics, worker_exited

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
PARENT_CHECK_S = 1.0
#: The pid a parent whose workers another supervisor starts (uvicorn's, for the gateway) leaves its
#: workers in the environment, for follow_parent: a worker started after that parent died sees it gone.
PARENT_PID_VAR = "EXAMLOPS_WORKERS_PARENT_PID"


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker knows of its place: its index, the port it shares and how to say it serves."""

    index: int
    count: int
    port: int
    parent_pid: int
    ready: Any  # a multiprocessing Event, set once the worker's server has started

    def started(self) -> None:
        self.ready.set()

    async def follow_parent(self) -> None:
        """SIGTERM to this worker (a graceful stop) once its parent has died."""
        await follow_parent(self.parent_pid, f"worker {self.index}")


async def follow_parent(parent_pid: int, who: str) -> None:
    """SIGTERM to this process (a graceful stop) once `parent_pid` is no longer its parent: a worker
    whose parent was killed would otherwise keep serving, and keep the port, with no one to stop it."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_CHECK_S)
    log.warning("%s: the parent process %d is gone; stopping", who, parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def check_port(host: str, port: int) -> int:
    """The port the workers will share (a free one for port 0); SystemExit when something listens there."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        # REUSEADDR as the server sets it: a closed connection's TIME_WAIT is no conflict, a listener is
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        return int(sock.getsockname()[1])


@dataclass
class _Worker:
    slot: WorkerSlot
    process: Any  # multiprocessing.Process (spawn context)
    serving: bool = False


@dataclass
class _Supervisor:
    service: str
    target: Callable[[WorkerSlot], None]
    port: int
    count: int
    workers: list[_Worker] = field(default_factory=list)
    stopping: bool = False
    ctx: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))

    def start(self, index: int) -> _Worker:
        slot = WorkerSlot(index, self.count, self.port, os.getpid(), self.ctx.Event())
        process = self.ctx.Process(target=self.target, args=(slot,), name=f"{self.service}-worker-{index}")
        process.start()
        return _Worker(slot, process)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def stop_all(self, grace_s: float) -> None:
        for w in self.workers:
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.warning("%s worker %d (pid %d) did not stop within %.0f s; killing it", self.service,
                            w.slot.index, w.process.pid, grace_s)
                w.process.kill()
                w.process.join(5)
            worker_exited(w.process.pid)

    def step(self) -> int | None:
        """One look at the workers: None while all is well, else the exit status of the service."""
        for i, w in enumerate(self.workers):
            if w.process.is_alive():
                w.serving = w.serving or w.slot.ready.is_set()
                continue
            code = w.process.exitcode
            # ready may have been set since the last look, just before the worker died
            if not (w.serving or w.slot.ready.is_set()):
                log.error("%s worker %d (pid %d) exited with status %s before it was serving (see its lines "
                          "above); stopping the service", self.service, w.slot.index, w.process.pid, code)
                return 1
            log.warning("%s worker %d (pid %d) died (status %s); starting another", self.service, w.slot.index,
                        w.process.pid, code)
            worker_exited(w.process.pid)
            self.workers[i] = self.start(w.slot.index)
        return None

    def run(self, grace_s: float) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        status = 0
        try:
            self.workers = [self.start(i) for i in range(self.count)]
            announced, deadline = False, time.monotonic() + START_TIMEOUT_S
            while not self.stopping:
                failed = self.step()
                if failed is not None:
                    status = failed
                    break
                if not announced and all(w.serving for w in self.workers):
                    announced = True
                    log.info("%s: %d workers serving on port %d (pids %s)", self.service, self.count, self.port,
                             " ".join(str(w.process.pid) for w in self.workers))
                elif not announced and time.monotonic() > deadline:
                    log.error("%s: the workers were not all serving within %.0f s", self.service, START_TIMEOUT_S)
                    status = 1
                    break
                wait([w.process.sentinel for w in self.workers], timeout=0.1 if not announced else 0.5)
        finally:
            self.stop_all(grace_s + 5)
        return status


def run_workers(service: str, count: int, host: str, port: int, metrics_port: int,
                target: Callable[[WorkerSlot], None], grace_s: float = 5.0) -> int:
    """Run `count` workers of `service` sharing host:port; returns the exit status (0 after SIGTERM).

    `target(slot)` runs in each worker (a module-level function or a partial of one: it is pickled)
    and serves on `slot.port` with SO_REUSEPORT, calling `slot.started()` once it listens.
    """
    port = check_port(host, port)
    log.info("%s: starting %d worker processes on port %d", service, count, port)
    with multiprocess_metrics(service, count):
        if metrics_port:
            serve_metrics(host, metrics_port)
        return _Supervisor(service, target, port, count).run(grace_s)
