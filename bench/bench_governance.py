"""Governance overhead: what a virtual key (auth + allow-list + rate limits + budget) adds per request.

    .venv/bin/python bench/bench_governance.py            # ~3 min
    .venv/bin/python bench/bench_governance.py --quick    # ~1 min
    .venv/bin/python bench/bench_governance.py --json out.json

Same parts and load generator as bench/bench_gateway.py (the registry's and the gateway's Redis,
the five services, the fast stub backend behind the endpoint `bench`), in one run. The baseline is
the admin key through the same gateway: no admission script, but the same cost record (one settle
round trip) as every call. The virtual key has a budget, an RPM and a TPM limit (all far from
binding) and a price on the model, so every request runs reserve.lua before dispatch and settle.lua
after.

Latency is measured at 1 client in rounds that alternate the two paths (so that drift of the machine
hits both); the added cost is the median over rounds of (virtual key - admin key) at p50 and p99.
Throughput and CPU per request (gateway, the gateway's Redis) come from a 32-client phase of each path.
The gateway's Redis runs as the stack runs it (appendfsync everysec: a write reaches the kernel before
the reply, the disk once a second; GOVERNANCE.md, Durability); the latency rounds are repeated with
appendfsync always (every write waits for the disk), to show what the disk would add.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402
import httpx  # noqa: E402
import redis  # noqa: E402

from examlops.registry.v1 import registry_pb2 as reg  # noqa: E402
from examlops.svc import DEFAULT_ADMIN_KEY  # noqa: E402

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}


@dataclass(frozen=True)
class Profile:
    rounds: int
    latency_requests: int
    latency_warmup: int
    throughput_requests: int
    max_seconds: float


PROFILES = {"full": Profile(rounds=4, latency_requests=1000, latency_warmup=100, throughput_requests=6000,
                            max_seconds=15),
            "quick": Profile(rounds=3, latency_requests=300, latency_warmup=50, throughput_requests=1500,
                             max_seconds=6)}


def governed_key(parts: bg.Parts) -> str:
    """Price the model, issue a key with a budget, RPM and TPM, and wait until the gateway has the price."""
    stack = parts.stack
    stack.registry().SetPrice(reg.SetPriceRequest(price=reg.Price(
        model=bg.ENDPOINT, input_micro_usd_per_mtok=150_000, output_micro_usd_per_mtok=600_000),
        actor="bench"), timeout=10)
    resp = httpx.post(stack.gateway_url + "/admin/keys", headers=ADMIN, json={
        "tenant": "bench", "project": "bench", "models": [bg.ENDPOINT], "budget_usd": 1_000_000,
        "rpm": 100_000_000, "tpm": 1_000_000_000})
    resp.raise_for_status()
    key: str = resp.json()["virtual_key"]
    deadline = time.monotonic() + 20
    while not any(p["model"] == bg.ENDPOINT for p in
                  httpx.get(stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]):
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not pick the price up within 20 s")
        time.sleep(0.2)
    probe = httpx.post(stack.gateway_url + bg.CHAT_PATH, content=bg.request_body(False),
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    if probe.status_code != 200:
        raise RuntimeError(f"the virtual key is refused: {probe.status_code} {probe.text[:300]}")
    return key


def measure(parts: bg.Parts, key: str, stream: bool, concurrency: int, requests: int, warmup: int,
            max_seconds: float) -> dict[str, Any]:
    return parts.loadgen.chat(parts.stack.gateway_url, key, stream, concurrency, (requests, warmup, max_seconds),
                              parts.pids, parts.stub_url)


def set_fsync(parts: bg.Parts, mode: str) -> None:
    """The appendfsync policy of the gateway's Redis (the one on the governed request path)."""
    client = redis.Redis(port=parts.stack.ports.gateway_redis or parts.stack.ports.redis)
    try:
        client.config_set("appendfsync", mode)
    finally:
        client.close()


def latency_rounds(parts: bg.Parts, paths: dict[str, str], stream: bool, profile: Profile,
                   note: str) -> list[dict[str, dict[str, Any]]]:
    kind = "stream" if stream else "non-stream"
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(profile.rounds):
        order = list(paths.items()) if i % 2 == 0 else list(reversed(paths.items()))
        one: dict[str, dict[str, Any]] = {}
        for label, k in order:
            bg.say(f"{kind:<10} 1 client   {note:<19} round {i + 1}/{profile.rounds}  {label}")
            one[label] = measure(parts, k, stream, 1, profile.latency_requests, profile.latency_warmup,
                                 profile.max_seconds)
        rounds.append(one)
    return rounds


def run(parts: bg.Parts, profile: Profile) -> dict[str, Any]:
    key = governed_key(parts)
    paths = {"admin key": DEFAULT_ADMIN_KEY, "virtual key": key}
    out: dict[str, Any] = {}
    for stream in (False, True):
        kind = "stream" if stream else "non-stream"
        rounds = latency_rounds(parts, paths, stream, profile, "appendfsync everysec")
        many: dict[str, dict[str, Any]] = {}
        for label, k in paths.items():
            bg.say(f"{kind:<10} 32 clients {label}")
            many[label] = measure(parts, k, stream, 32, profile.throughput_requests, profile.throughput_requests // 10,
                                  profile.max_seconds)
        # The same with Redis fsyncing before every reply: what the governance path would cost if
        # each of its writes waited for the disk.
        set_fsync(parts, "always")
        try:
            strict = latency_rounds(parts, paths, stream, profile, "appendfsync always")
        finally:
            set_fsync(parts, "everysec")
        out[kind] = {"rounds": rounds, "throughput": many, "rounds_always": strict}
    return out


def _med(rounds: list[dict[str, dict[str, Any]]], label: str, field: str) -> float:
    return statistics.median(r[label][field] for r in rounds)


def report(results: dict[str, Any], profile_name: str) -> str:
    lines = [f"\nGovernance overhead ({profile_name} run; {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             "one gateway worker, loopback, the stub backend)",
             "baseline: the admin key (no admission; the same per-call cost record); "
             "virtual key: auth + allow-list + RPM + TPM + budget reserve, and its settle\n"]
    head = (f"{'scenario':<22} {'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'req/s @32':>10} "
            f"{'gateway CPU ms/req':>19} {'Redis CPU ms/req':>17}")
    lines += [head, "-" * len(head)]
    for kind, res in results.items():
        rounds, many = res["rounds"], res["throughput"]
        for label in ("admin key", "virtual key"):
            cpu = many[label]["cpu_ms_per_request"]
            lines.append(f"{kind + ', 1 / 32 clients' if label == 'admin key' else '':<22} {label:<12} "
                         f"{_med(rounds, label, 'p50_ms'):>8.3f} {_med(rounds, label, 'p99_ms'):>8.3f} "
                         f"{many[label]['rps']:>10.0f} {cpu['gateway']:>19.3f} {cpu['other:redis']:>17.3f}")
        d50 = statistics.median(r["virtual key"]["p50_ms"] - r["admin key"]["p50_ms"] for r in rounds)
        d99 = statistics.median(r["virtual key"]["p99_ms"] - r["admin key"]["p99_ms"] for r in rounds)
        a, v = many["admin key"], many["virtual key"]
        dcpu = v["cpu_ms_per_request"]["gateway"] - a["cpu_ms_per_request"]["gateway"]
        lines.append(f"{'':<22} {'added':<12} {d50:>+8.3f} {d99:>+8.3f} {v['rps'] / a['rps']:>9.3f}× "
                     f"{dcpu:>+19.3f}")
        lines.append(f"{'':<22} (per-round p50 deltas: "
                     + ", ".join(f"{r['virtual key']['p50_ms'] - r['admin key']['p50_ms']:+.3f}" for r in rounds)
                     + " ms)")
        strict = res["rounds_always"]
        r50 = statistics.median(r["virtual key"]["p50_ms"] - r["admin key"]["p50_ms"] for r in strict)
        r99 = statistics.median(r["virtual key"]["p99_ms"] - r["admin key"]["p99_ms"] for r in strict)
        lines.append(f"{'':<22} {'added*':<12} {r50:>+8.3f} {r99:>+8.3f}   * Redis appendfsync always "
                     f"(admin p50 {_med(strict, 'admin key', 'p50_ms'):.3f} ms)\n")
    foreign = max(m["foreign_cpu_cores"] for res in results.values() for m in res["throughput"].values())
    if foreign > 0.15:
        lines.append(f"WARNING: other processes used up to {foreign:.2f} CPUs during a measurement; "
                     "run again on an idle machine for numbers to compare")
    return "\n".join(lines)


def _measure(workdir: Path, profile_name: str) -> tuple[str, dict[str, Any]]:
    with bg.bring_up(workdir) as parts:
        results = run(parts, PROFILES[profile_name])
        bg.say("stopping everything")
    return report(results, profile_name), {"results": results}


def main(argv: list[str] | None = None) -> int:
    args = bg.bench_parser(__doc__, "a ~1 min run with fewer requests").parse_args(argv)
    return bg.run_bench(args, "examlops-bench-gov-", _measure, errors=(httpx.HTTPError,))


if __name__ == "__main__":
    sys.exit(main())
