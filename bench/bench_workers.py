"""Gateway throughput with one worker process against two (EXAMLOPS_WORKERS), governed key, 32 clients.

    .venv/bin/python bench/bench_workers.py            # ~3 min
    .venv/bin/python bench/bench_workers.py --quick    # ~1 min
    .venv/bin/python bench/bench_workers.py --json out.json

Same parts and load generator as bench/bench_gateway.py (Redis, the five services, the fast stub
behind the endpoint `bench`), plus a second gateway on its own port started with EXAMLOPS_WORKERS=2
(and, with --engine-proxy-workers 2, a second engine-proxy with two workers behind it). Both
gateways share Redis, engine-proxy and the virtual key of bench_governance (a budget, RPM and TPM
far from binding). Rounds alternate the two gateways, non-streamed and streamed, so that drift of
the machine hits both; the result is the median req/s over rounds and its ratio, and the CPU each
process class spent per request (gateway: all its workers) with the cores it kept busy. On a
2-core machine a second worker can only help as far as the other processes leave a core free:
the "cores busy" columns say where the CPU went.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402
from _rounds import Profile  # noqa: E402
from bench_governance import governed_key  # noqa: E402

from examlops_devstack import free_port, service_argv, spawn, wait_grpc  # noqa: E402

CONCURRENCY = 32
CLASSES = ("gateway", "engine-proxy", "stub", "client", "redis")


PROFILES = {"full": Profile(rounds=4, requests=6000, warmup=600, max_seconds=15),
            "quick": Profile(rounds=2, requests=1500, warmup=200, max_seconds=6)}


def workers_of(pid: int) -> list[int]:
    """The worker processes a multi-worker parent started (multiprocessing spawn children)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return sorted(found)


@dataclass
class Target:
    label: str
    url: str
    pids: dict[str, int]  # "<class>:<pid>" -> pid, every process that serves this path


def pids_of(cls: str, pid: int) -> dict[str, int]:
    return {f"{cls}:{p}": p for p in (workers_of(pid) or [pid])}


def targets(parts: bg.Parts, ep_workers: int) -> list[Target]:
    stack = parts.stack
    common = {"stub": parts.pids["stub"], "client": parts.pids["client"], "redis": parts.pids["other:redis"]}
    ep_pid = parts.pids["engine-proxy"]
    env: dict[str, str] = {"EXAMLOPS_WORKERS": "2"}
    if ep_workers > 1:
        port = free_port()
        ep = spawn("engine-proxy-2w", service_argv("engine-proxy"),
                   {**stack.env("engine-proxy"), "EXAMLOPS_WORKERS": str(ep_workers), "EXAMLOPS_PORT": str(port)},
                   stack.workdir / "engine-proxy-2w.log")
        stack.procs["engine-proxy-2w"] = ep  # stopped with the stack
        wait_grpc(f"127.0.0.1:{port}", 30, ep)
        env["EXAMLOPS_ENGINE_PROXY_ADDR"] = f"127.0.0.1:{port}"
        ep_two = ep.pid
    proc, url = stack.start_gateway_replica("gateway-2w", env)
    bg.check_with_openai(url, "gateway, 2 workers")
    one = Target("1 worker", stack.gateway_url, {**common, **pids_of("gateway", parts.pids["gateway"]),
                                                  **pids_of("engine-proxy", ep_pid)})
    two = Target("2 workers", url, {**common, **pids_of("gateway", proc.pid),
                                    **pids_of("engine-proxy", ep_two if ep_workers > 1 else ep_pid)})
    for t in (one, two):
        bg.say(f"{t.label}: " + ", ".join(f"{c} {sum(1 for k in t.pids if k.startswith(c + ':'))} process(es)"
                                          for c in ("gateway", "engine-proxy")))
    return [one, two]


def by_class(res: dict[str, Any]) -> dict[str, float]:
    """CPU ms per request summed per process class."""
    out = dict.fromkeys(CLASSES, 0.0)
    for name, ms in res["cpu_ms_per_request"].items():
        cls = name.split(":", 1)[0]
        if cls in out:
            out[cls] += ms
    return out


def run(parts: bg.Parts, profile: Profile, ep_workers: int) -> dict[str, Any]:
    key = governed_key(parts)
    pair = targets(parts, ep_workers)
    rounds: list[dict[str, Any]] = []
    for i in range(profile.rounds):
        for stream in (False, True):
            order = pair if i % 2 == 0 else list(reversed(pair))
            for t in order:
                kind = "stream" if stream else "non-stream"
                bg.say(f"round {i + 1}/{profile.rounds}  {kind:<10} {CONCURRENCY} clients  gateway {t.label}")
                load = (profile.requests, profile.warmup, profile.max_seconds)
                res = parts.loadgen.chat(t.url, key, stream, CONCURRENCY, load, t.pids, parts.stub_url)
                rounds.append({"round": i, "stream": stream, "target": t.label, "rps": res["rps"],
                               "cpu_ms": by_class(res), "foreign_cpu_cores": res["foreign_cpu_cores"],
                               "errors": res["errors"]})
    return {"rounds": rounds, "engine_proxy_workers_of_the_2_worker_path": ep_workers, "cpus": os.cpu_count()}


def report(results: dict[str, Any], profile_name: str) -> str:
    rows = results["rounds"]
    lines = [f"Gateway workers, governed key, {CONCURRENCY} clients ({profile_name} profile, "
             f"{os.cpu_count()} CPUs; the 2-worker path uses "
             f"{results['engine_proxy_workers_of_the_2_worker_path']} engine-proxy worker(s))", ""]
    head = (f"{'':<12}{'gateway':<11}{'req/s':>8}  " + "".join(f"{c:>13}" for c in CLASSES)
            + f"{'other load':>12}{'ceiling':>9}")
    lines += [head, f"{'':<12}{'':<11}{'':>8}  " + "".join(f"{'ms/req cores':>13}" for _ in CLASSES)
              + f"{'cores':>12}{'req/s':>9}"]
    for stream in (False, True):
        kind = "stream" if stream else "non-stream"
        rps: dict[str, float] = {}
        for label in ("1 worker", "2 workers"):
            mine = [r for r in rows if r["stream"] == stream and r["target"] == label]
            rps[label] = statistics.median(r["rps"] for r in mine)
            cpu = {c: statistics.median(r["cpu_ms"][c] for r in mine) for c in CLASSES}
            foreign = statistics.median(r["foreign_cpu_cores"] for r in mine)
            cells = "".join(f"{cpu[c]:>7.3f} {cpu[c] * rps[label] / 1000:>4.2f} " for c in CLASSES)
            ceiling = (os.cpu_count() or 1) * 1000 / sum(cpu.values())
            lines.append(f"{kind:<12}{label:<11}{rps[label]:>8.0f}  {cells}{foreign:>11.2f}{ceiling:>9.0f}")
        ratio = rps["2 workers"] / rps["1 worker"]
        lines.append(f"{'':<12}2 workers / 1 worker: {ratio:.2f}x (target >= 1.6x)")
    errors = sum(r["errors"] for r in rows)
    lines += ["", "ms/req: CPU per request of the class (gateway: all its workers); cores: ms/req x req/s; other "
                  "load: CPU of processes outside the run (another workload skews the numbers);",
              "ceiling: the req/s at which these processes alone would keep every CPU of the machine busy."]
    if errors:
        lines.append(f"WARNING: {errors} failed requests")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bg.bench_parser(__doc__, "a ~1 min run with two rounds of fewer requests")
    ap.add_argument("--engine-proxy-workers", type=int, default=1, choices=(1, 2),
                    help="engine-proxy workers behind the 2-worker gateway (default 1: the same engine-proxy)")
    args = ap.parse_args(argv)

    def _measure(workdir: Path, profile_name: str) -> tuple[str, dict[str, Any]]:
        with bg.bring_up(workdir) as parts:
            results = run(parts, PROFILES[profile_name], args.engine_proxy_workers)
            bg.say("stopping everything")
        return report(results, profile_name), results

    return bg.run_bench(args, "examlops-bench-workers-", _measure)


if __name__ == "__main__":
    sys.exit(main())
