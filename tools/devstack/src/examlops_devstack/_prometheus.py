"""`make up`'s Prometheus: the shipped config (observability/prometheus/) rendered for local processes.

The shipped `prometheus.yml` names Compose services; `render_local_config` keeps its jobs, rules and
file_sd folder and only swaps each job's discovery for the local addresses (a job with none is
dropped: no vLLM under ENGINE=echo, so no VLLMEndpointDown either). The binary is Debian's
`prometheus`; without it `make up` says how to install it and carries on.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from examlops.yamlio import dump_yaml

from ._procs import Proc, http_ok, spawn
from ._rundir import RunDir, say
from ._stack import SERVICES, StackPorts

#: The shipped configuration: prometheus.yml, rules/*.yml, tests/*.yml and the file_sd folder targets/.
OBSERVABILITY_DIR = Path(__file__).resolve().parents[4] / "observability" / "prometheus"
PROMETHEUS_INSTALL_HINT = "apt-get install prometheus (Debian's package: the prometheus server and promtool)"
#: Service discovery of the shipped file that `render_local_config` replaces by static targets.
_DISCOVERY = ("static_configs", "dns_sd_configs", "kubernetes_sd_configs")


def shipped_config(path: Path = OBSERVABILITY_DIR / "prometheus.yml") -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    return config


def local_targets(ports: StackPorts, engine: str) -> dict[str, list[str]]:
    """job -> the host:port addresses of the local stack's /metrics pages (the shipped job names)."""
    targets = {name: [f"127.0.0.1:{ports.metrics[name]}"] for name in SERVICES if name in ports.metrics}
    targets["gateway"] = [ports.gateway_url.removeprefix("http://")]
    targets["vllm"] = [f"127.0.0.1:{ports.vllm}", f"127.0.0.1:{ports.minilm}"] if engine == "vllm" else []
    return targets


def render_local_config(targets: dict[str, list[str]], shipped: dict[str, Any] | None = None,
                        base_dir: Path = OBSERVABILITY_DIR, scrape_interval: str | None = None) -> dict[str, Any]:
    """The shipped config with each job in `targets` scraping those addresses (jobs without any are
    dropped; a file_sd job keeps its files) and every relative path made absolute against `base_dir`."""
    config = shipped if shipped is not None else shipped_config(base_dir / "prometheus.yml")
    out = {**config, "rule_files": [str(base_dir / p) for p in config.get("rule_files", [])]}
    if scrape_interval:
        out["global"] = {**config.get("global", {}), "scrape_interval": scrape_interval,
                         "evaluation_interval": scrape_interval, "scrape_timeout": scrape_interval}
    jobs = []
    for job in config["scrape_configs"]:
        name = job["job_name"]
        if "file_sd_configs" in job:
            files = [{**sd, "files": [str(base_dir / f) for f in sd["files"]]} for sd in job["file_sd_configs"]]
            jobs.append({**job, "file_sd_configs": files})
        elif targets.get(name):
            kept = {k: v for k, v in job.items() if k not in _DISCOVERY}
            jobs.append({**kept, "static_configs": [{"targets": targets[name]}]})
    out["scrape_configs"] = jobs
    return out


def prometheus_argv(exe: str, config: Path, data: Path, listen: str) -> list[str]:
    return [exe, f"--config.file={config}", f"--storage.tsdb.path={data}", f"--web.listen-address={listen}",
            "--storage.tsdb.retention.time=7d"]


def start_prometheus(run: RunDir, ports: StackPorts, engine: str) -> str | None:
    """Write `.run/prometheus/prometheus.yml` and start Prometheus on it (or make a running one
    re-read it); its URL, or None when the binary is missing."""
    exe = shutil.which("prometheus")
    url = ports.prometheus_url
    if exe is None:
        say(f"prometheus: not installed, so no metrics or alerts at {url}; `{PROMETHEUS_INSTALL_HINT}` adds it")
        return None
    root = run.root / "prometheus"
    root.mkdir(parents=True, exist_ok=True)
    config = root / "prometheus.yml"
    config.write_text(dump_yaml(render_local_config(local_targets(ports, engine))))
    pid = run.pid("prometheus")
    if pid is not None and http_ok(url + "/-/ready"):
        os.kill(pid, signal.SIGHUP)  # Prometheus re-reads its configuration on SIGHUP
        say(f"prometheus: already running (pid {pid}), configuration reloaded")
        return url
    if http_ok(url + "/-/ready"):
        say(f"prometheus: port {ports.prometheus} is taken by a Prometheus `make up` did not start; carrying on")
        return None
    proc = spawn("prometheus", prometheus_argv(exe, config, root / "data", f"127.0.0.1:{ports.prometheus}"),
                 run.env, run.logs / "prometheus.log")
    run.record("prometheus", proc)
    try:
        wait_prometheus_ready(url, proc)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    say(f"prometheus: started (pid {proc.pid}) at {url}")
    return url


def wait_prometheus_ready(url: str, proc: Proc, timeout_s: float = 60) -> None:
    """Until `url` is ready; RuntimeError with the end of its log (and the process stopped) if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while not http_ok(url + "/-/ready"):
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"prometheus did not become ready at {url}:\n{proc.log_tail()}")
        time.sleep(0.1)
