"""The real Prometheus and promtool for the tests (Debian's `prometheus` package, which `make test`
installs): the shipped rules, a Prometheus on a config rendered from the shipped one, its HTTP API."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from examlops.yamlio import dump_yaml
from examlops_devstack import (
    OBSERVABILITY_DIR,
    PROMETHEUS_INSTALL_HINT,
    free_port,
    prometheus_argv,
    render_local_config,
    spawn,
    wait_prometheus_ready,
)

__all__ = [
    "OBSERVABILITY_DIR",
    "alert_rules",
    "metric_names",
    "promtool",
    "query",
    "running_prometheus",
    "scraped_names",
]

#: PromQL words that look like metric names in an expression.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def _binary(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed: {PROMETHEUS_INSTALL_HINT}; `make test` installs it")
    return exe


def promtool(*args: str, cwd: Path = OBSERVABILITY_DIR) -> subprocess.CompletedProcess[str]:
    """`promtool <args>` in `cwd` (the shipped folder: its relative paths resolve there)."""
    return subprocess.run([_binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def alert_rules(rules_dir: Path = OBSERVABILITY_DIR / "rules") -> dict[str, dict[str, Any]]:
    """alert name -> its rule, over every shipped rules file."""
    rules: dict[str, dict[str, Any]] = {}
    for path in sorted(rules_dir.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules |= {rule["alert"]: rule for rule in group["rules"] if "alert" in rule}
    return rules


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and label names left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", text):
        if not text[m.end():].lstrip().startswith("(") and m.group(0).lower() not in PROMQL_WORDS:
            names.add(m.group(0))
    return names


def scraped_names(page: str) -> set[str]:
    """Every sample name of a Prometheus text page (x_total, x_bucket, ... as Prometheus stores them)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for family in text_string_to_metric_families(page) for s in family.samples}


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """The instant vector `promql` evaluates to now, through Prometheus' HTTP API."""
    resp = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: dict[str, list[str]], scrape_interval: str = "1s") -> Iterator[str]:
    """The real Prometheus on a free port, on the shipped config rendered for `targets` (job ->
    addresses; the shipped rules loaded, evaluated every `scrape_interval`); yields its URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(dump_yaml(render_local_config(targets, scrape_interval=scrape_interval)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn("prometheus", prometheus_argv(_binary("prometheus"), config, workdir / "data", f"127.0.0.1:{port}"),
                 {}, workdir / "prometheus.log")
    try:
        wait_prometheus_ready(url, proc)
        yield url
    finally:
        proc.stop()
