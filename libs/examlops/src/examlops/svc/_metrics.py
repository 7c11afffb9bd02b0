"""Prometheus metrics of a service that runs as several worker processes (EXAMLOPS_WORKERS > 1).

prometheus_client keeps a process's samples in that process: behind one port served by several
workers, a scrape would see whichever worker answered it. In multiprocess mode every process
writes its samples to memory-mapped files in PROMETHEUS_MULTIPROC_DIR and a scrape merges them:
counters and histograms are summed over the workers (dead ones included, so totals never go back),
each gauge by the `multiprocess_mode` it was declared with. prometheus_client chooses its storage
when it is imported, so the parent sets the variable before it starts the workers.

With one worker nothing changes: no directory, no files, the default registry. In multiprocess
mode there are no per-process series (process_*, python_gc_*): they would describe one worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger(__name__)

MULTIPROC_VAR = "PROMETHEUS_MULTIPROC_DIR"


def _dir_prefix(service: str) -> str:
    return f"examlops-{service}-metrics-"


def metrics_dir(service: str, parent_pid: int) -> list[Path]:
    """The metrics directories of the service started by `parent_pid` (zero or one; tests look there)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{_dir_prefix(service)}{parent_pid}-*"))


def _sweep_stale(service: str) -> None:
    """Remove the directories a killed parent of this service left behind: its pid is gone, or is
    this process's (a container restarted in a fresh pid namespace gives the parent the same pid)."""
    pattern = re.compile(re.escape(_dir_prefix(service)) + r"(\d+)-")
    for path in Path(tempfile.gettempdir()).glob(_dir_prefix(service) + "*"):
        match = pattern.match(path.name)
        if match is None or not path.is_dir():
            continue
        pid = int(match.group(1))
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


@contextlib.contextmanager
def multiprocess_metrics(service: str, workers: int) -> Iterator[Path | None]:
    """For `workers` > 1: a fresh directory for the workers' samples, named in PROMETHEUS_MULTIPROC_DIR
    for the processes started inside the block, removed when the block ends. None (and nothing set)
    for one worker."""
    if workers <= 1:
        yield None
        return
    _sweep_stale(service)
    path = Path(tempfile.mkdtemp(prefix=f"{_dir_prefix(service)}{os.getpid()}-"))
    previous = os.environ.get(MULTIPROC_VAR)
    os.environ[MULTIPROC_VAR] = str(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if previous is None:
            os.environ.pop(MULTIPROC_VAR, None)
        else:
            os.environ[MULTIPROC_VAR] = previous


def multiprocess_enabled() -> bool:
    """True in a worker of a multi-worker service (its samples go to the shared directory)."""
    return bool(os.environ.get(MULTIPROC_VAR))


def metrics_registry() -> CollectorRegistry:
    """What a scrape reads: every worker's samples merged in multiprocess mode, else this process's."""
    if not multiprocess_enabled():
        return REGISTRY
    registry = CollectorRegistry(auto_describe=True)
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


def serve_metrics(host: str, port: int) -> None:
    """The /metrics HTTP exporter on `port` (a daemon thread), merged over workers in multiprocess mode."""
    start_http_server(port, addr=host, registry=metrics_registry())


def worker_exited(pid: int) -> None:
    """Forget a dead worker's live gauges (its counters stay in the sums)."""
    if multiprocess_enabled():
        mark_process_dead(pid)  # type: ignore[no-untyped-call]
