"""Peers: LiteLLM's proxy, a plain pass-through proxy and our stack in front of the same stub, in one run.

    make bench-peers                                   # installs LiteLLM once, then the full run (~7 min)
    .venv/bin/python bench/bench_peers.py --quick      # ~2.5 min
    .venv/bin/python bench/bench_peers.py --litellm-venv DIR --results-dir DIR --no-pin

Brings up Redis, the five services and the stub (bench_gateway.bring_up; EXAMLOPS_WORKERS is passed
on to the gateway and engine-proxy when set), the plain proxy (bench/plain_proxy.py) and LiteLLM's
proxy (scripts/litellm-env.sh's environment, offline, one worker), all on the stub's endpoint
`bench`. Targets: the stub called directly (the baseline), the plain proxy, ours with the admin key,
ours with a virtual key whose budget, RPM and TPM are far from binding on a priced model, LiteLLM.

Points: non-streamed and streamed, at 1 client (p50, p99, TTFT: the load generator's time to the
first `data:` event) and at 32 clients (req/s). In each round every point drives every target with
the same load generator, in an order that rotates per round, each warmed up first. With `taskset`
the proxy under test (for ours: gateway and engine-proxy together) runs on the first CPU this run may
use; the stub, the load generator, Redis and the rest on the second.

Prints the peers table, the ratios and the issue's targets (met / NOT met), and writes them with the
machine's description to bench/results/peers-<UTC date>-<hostname>.{json,md}. Exit status 1 when a
target could not be measured (for instance LiteLLM did not start); met or not is no failure.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402
import httpx  # noqa: E402
import peers_report as pr  # noqa: E402
import peers_targets as pt  # noqa: E402
import redis  # noqa: E402
from bench_governance import governed_key  # noqa: E402

from examlops.svc import DEFAULT_ADMIN_KEY  # noqa: E402


@dataclass(frozen=True)
class Profile:
    rounds: int
    requests_c1: int
    warmup_c1: int
    requests_c32: int
    warmup_c32: int
    max_seconds: float  # cap of one measured phase (and of its warm-up): LiteLLM's are the long ones


PROFILES = {"full": Profile(rounds=2, requests_c1=1000, warmup_c1=100, requests_c32=3000, warmup_c32=300,
                            max_seconds=20),
            "quick": Profile(rounds=2, requests_c1=300, warmup_c1=50, requests_c32=1000, warmup_c32=100,
                             max_seconds=6)}


@dataclass(frozen=True)
class Target:
    url: str
    api_key: str


def pin_all(parts: bg.Parts, peers: dict[str, int], cpus: tuple[int, int]) -> dict[str, str]:
    """The first CPU: the proxies under test (each with its threads and children); the second:
    everything else."""
    proxy_cpu, rest_cpu = cpus
    on_proxy = {"gateway": parts.pids["gateway"], "engine-proxy": parts.pids["engine-proxy"], **peers}
    on_rest = {name.removeprefix("other:"): pid for name, pid in parts.pids.items()
               if name not in on_proxy and name not in ("gateway", "engine-proxy")}
    on_rest["bench"] = os.getpid()
    counts = {name: len(pt.pin(pid, proxy_cpu)) for name, pid in on_proxy.items()}
    for pid in on_rest.values():
        pt.pin(pid, rest_cpu)
    return {f"CPU {proxy_cpu}": ", ".join(f"{n} ({c} process{'es' if c > 1 else ''})" for n, c in counts.items()),
            f"CPU {rest_cpu}": ", ".join(on_rest)}


def measure_point(parts: bg.Parts, targets: dict[str, Target], point: str, profile: Profile,
                  round_i: int) -> dict[str, dict[str, Any]]:
    stream, clients = pr.POINTS[point]
    names = list(targets)
    order = names[round_i % len(names):] + names[:round_i % len(names)]
    one = clients == 1
    out: dict[str, dict[str, Any]] = {}
    for name in order:
        t = targets[name]
        load = (profile.requests_c1 if one else profile.requests_c32, profile.warmup_c1 if one else profile.warmup_c32,
                profile.max_seconds)
        bg.say(f"round {round_i + 1}/{profile.rounds}  {point:<16} {name}")
        out[name] = parts.loadgen.chat(t.url, t.api_key, stream, clients, load, parts.pids, parts.stub_url,
                                       label=f"{name}: ")
    return out


def redis_fsync(parts: bg.Parts) -> dict[str, str]:
    """appendfsync of the gateway's Redis (budgets, keys: on the governed path) and of the registry's."""
    ports = parts.stack.ports
    out = {}
    for name, port in (("gateway_redis_appendfsync", getattr(ports, "gateway_redis", None) or ports.redis),
                       ("registry_redis_appendfsync", ports.redis)):
        client = redis.Redis(port=port)
        try:
            out[name] = str(client.config_get("appendfsync").get("appendfsync", "unknown"))
        finally:
            client.close()
    return out


def run(workdir: Path, profile_name: str, litellm_venv: Path, pinning: bool) -> dict[str, Any]:
    profile = PROFILES[profile_name]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    load_before = os.getloadavg()[0]
    with bg.bring_up(workdir) as parts, contextlib.ExitStack() as peers:
        key = governed_key(parts)
        plain, plain_url = pt.start_plain_proxy(parts.stub_url, workdir / "plain-proxy.log")
        peers.callback(plain.stop)
        bg.check_with_openai(plain_url, "plain proxy")
        targets = {"direct": Target(parts.stub_url, DEFAULT_ADMIN_KEY), "plain": Target(plain_url, DEFAULT_ADMIN_KEY),
                   "admin": Target(parts.stack.gateway_url, DEFAULT_ADMIN_KEY),
                   "governed": Target(parts.stack.gateway_url, key)}
        peer_pids = {"plain-proxy": plain.pid}
        litellm = "not started"
        bg.say(f"starting LiteLLM from {litellm_venv}")
        try:
            proc, url = pt.start_litellm(litellm_venv, bg.ENDPOINT, parts.stub_url, workdir / "litellm")
            peers.callback(proc.stop)
            bg.check_with_openai(url, "LiteLLM", api_key=pt.LITELLM_MASTER_KEY)
            targets["litellm"] = Target(url, pt.LITELLM_MASTER_KEY)
            peer_pids["litellm"] = proc.pid
            litellm = pt.litellm_version(litellm_venv)
        except (RuntimeError, TimeoutError, AssertionError) as exc:
            bg.say(f"warning: LiteLLM is left out of this run: {exc}")
        parts.pids.update(peer_pids)  # their CPU per request lands in the raw results too
        cpus = pt.pin_cpus() if pinning else None
        if cpus is not None:
            pins = pin_all(parts, peer_pids, cpus)
        else:
            pins = {"none": "not pinned (--no-pin, fewer than 2 CPUs or no taskset)"}
        bg.say("pinning: " + "; ".join(f"{k}: {v}" for k, v in pins.items()))
        raw: dict[str, pr.Rounds] = {point: [] for point in pr.POINTS}
        for i in range(profile.rounds):
            for point in pr.POINTS:
                raw[point].append(measure_point(parts, targets, point, profile, i))
        machine = pt.machine_description(litellm, pins, {
            "gateway_workers": os.environ.get("EXAMLOPS_WORKERS", "1"), **redis_fsync(parts),
            "load_average_1min": f"{load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"})
        bg.say("stopping everything")
    return pr.build_run(raw, machine, profile_name, date, profile.rounds, profile.requests_c1, profile.requests_c32)


def main(argv: list[str] | None = None) -> int:
    ap = bg.bench_parser(__doc__, "a ~2.5 min run with fewer requests")
    ap.add_argument("--litellm-venv", type=Path, default=Path(os.environ.get("LITELLM_VENV") or
                                                                 pt.default_litellm_venv()),
                    help="LiteLLM's virtual environment (default: the one scripts/litellm-env.sh builds)")
    ap.add_argument("--results-dir", type=Path, default=BENCH / "results",
                    help="where peers-<date>-<host>.json and .md go (default: bench/results)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    args = ap.parse_args(argv)
    missing: list[str] = []

    def measure(workdir: Path, profile_name: str) -> tuple[str, dict[str, Any]]:
        result = run(workdir, profile_name, args.litellm_venv, not args.no_pin)
        js, md = pr.write_results(result, args.results_dir)
        bg.say(f"results written to {js} and {md}")
        missing.extend(pr.unmeasured(result))
        return pr.markdown(result), result

    rc = bg.run_bench(args, "examlops-bench-peers-", measure, errors=(httpx.HTTPError,))
    if rc == 0 and missing:
        bg.say(f"{len(missing)} target(s) could not be measured: " + "; ".join(missing))
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
