"""Routing cost: engine-proxy's CPU per request on a two-replica endpoint against a one-replica one.

    .venv/bin/python bench/bench_routing.py            # ~6 min
    .venv/bin/python bench/bench_routing.py --quick    # ~1.5 min
    .venv/bin/python bench/bench_routing.py --json out.json

Starts Redis, the five services (tests/_fixtures.py, as bench_gateway.py does) and two stub backends
(bench/stub_backend.py), and registers four endpoints on them: `route-one` (one replica, the first
stub), `route-one-b` (one replica, the second stub: the control, whose difference from `route-one`
is the run's noise floor), `route-ll` (both stubs, routing least-load) and `route-px` (both stubs,
routing prefix). A gRPC load generator (this file run with --client, its own process) sends Generate
calls straight to engine-proxy from 32 concurrent clients on one channel, as the gateway does: chat
requests with one of eight ~4,000-character system prompts, so that the prefix policy has keys to
hash and spread.

Each round measures the four endpoints in a rotating order (drift of the machine hits all of
them), twice: closed loop (32 requests always in flight, the issue's condition) and paced (the same
32 clients offering --rate requests a second together). Closed-loop throughput moves with whatever
else runs on the machine, and engine-proxy's CPU per request moves with its throughput (batching);
the paced phase holds the rate equal for every endpoint, so its difference is the steadier one.
Engine-proxy's CPU per request comes from /proc/<pid>/stat sampled around the measured requests
only. The added cost of a policy is the median over rounds of (its CPU per request - the one-replica
endpoint's), against issue 11's budget of 0.1 ms. Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402
import grpc  # noqa: E402
from _rounds import Profile  # noqa: E402
from loadgen import emit, serve, summarize  # noqa: E402

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb  # noqa: E402
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc  # noqa: E402
from examlops.registry.v1 import registry_pb2 as reg  # noqa: E402
from examlops.svc import insecure_channel  # noqa: E402
from examlops_devstack import free_port, spawn, wait_http  # noqa: E402
from examlops_engine_proxy._routing import Router, affinity_key  # noqa: E402
from examlops_testsupport.fixtures import Stack, running_stack, start_redis  # noqa: E402
from examlops_testsupport.routing import CandidateState  # noqa: E402

BUDGET_MS = 0.1
#: The paced phases' offered load: below what engine-proxy sustains on a shared 2-CPU machine.
RATE = 300.0
SYSTEM_PROMPTS = 8
#: label -> (endpoint, routing, replicas); "control" is a second one-replica endpoint (on the other
#: stub): its difference from "one replica" is the run's noise floor.
ROUTES = {"one replica": ("route-one", "least-load", 1),
          "control": ("route-one-b", "least-load", 1),
          "least-load": ("route-ll", "least-load", 2),
          "prefix": ("route-px", "prefix", 2)}


PROFILES = {"full": Profile(rounds=5, requests=4000, warmup=400, max_seconds=15),
            "quick": Profile(rounds=3, requests=1500, warmup=200, max_seconds=6)}


def chat_body(i: int) -> bytes:
    """A chat request whose ~4,000-character system prompt is one of eight (by client)."""
    rules = " ".join(f"Rule {n}: answer about product {i % SYSTEM_PROMPTS} precisely." for n in range(80))
    return json.dumps({"model": "bench", "max_tokens": 16, "messages": [
        {"role": "system", "content": f"You are support agent {i % SYSTEM_PROMPTS}. {rules}"},
        {"role": "user", "content": f"Question {i}: what is the refund policy?"}]}).encode()


# ---------------------------------------------------------------------------------------------
# The gRPC load generator (a child process speaking loadgen.py's stdin/stdout protocol)


async def _client_phase(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    channel = insecure_channel(spec["addr"], spec["token"])
    stub = pb_grpc.EngineProxyStub(channel)
    concurrency = int(spec["concurrency"])
    reqs = [pb.GenerateRequest(endpoint=spec["endpoint"], kind=pb.REQUEST_KIND_CHAT, body_json=chat_body(i))
            for i in range(concurrency)]
    failures: list[str] = []

    rate = float(spec["rate"])
    interval = concurrency / rate if rate > 0 else 0.0   # each client's period when paced

    async def worker(i: int, quota: list[int], deadline: float, lat: list[int] | None) -> None:
        due = time.monotonic() + i * interval / concurrency
        while quota[0] > 0 and time.monotonic() < deadline:
            quota[0] -= 1
            if interval:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                due = max(due + interval, time.monotonic())
            t0 = time.perf_counter_ns()
            try:
                async for _ in stub.Generate(reqs[i], timeout=30):
                    pass
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            if lat is not None:
                lat.append(time.perf_counter_ns() - t0)

    async def run(requests: int, lat: list[int] | None) -> float:
        quota, deadline, start = [requests], time.monotonic() + float(spec["max_seconds"]), time.perf_counter()
        await asyncio.gather(*(worker(i, quota, deadline, lat) for i in range(concurrency)))
        return time.perf_counter() - start

    try:
        await run(int(spec["warmup"]), None)
        emit({"event": "ready", "warmup_errors": len(failures), "first_error": failures[0] if failures else ""})
        failures.clear()
        if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
            return
        lat: list[int] = []
        elapsed = await run(int(spec["requests"]), lat)
        emit(summarize(lat, elapsed, len(failures), failures[0] if failures else ""))
    finally:
        await channel.close()


class GrpcLoadGen(bg.LoadGen):
    """bench_gateway's LoadGen driving this file's --client child instead of the HTTP one."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, __file__, "--client"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.lines: Queue[str] = Queue()
        threading.Thread(target=self._pump, daemon=True).start()


# ---------------------------------------------------------------------------------------------
# Bringing the parts up


@dataclass
class Parts:
    stack: Stack
    stubs: list[str]
    loadgen: GrpcLoadGen
    pids: dict[str, int]
    background_ms_per_s: float     # engine-proxy's idle CPU the two pools add (their scrapes and probes)


def _register(stack: Stack, stubs: list[str], pools: bool) -> None:
    for label, (name, routing, n) in ROUTES.items():
        if (n > 1) != pools:
            continue
        urls = stubs[1:] if label == "control" else stubs[:n]
        block = json.dumps({"engine": "vllm-server", "base_url": urls[0], "routing": routing})
        stack.register(name, engine="vllm-server", engine_block_json=block,
                       replicas=[reg.Replica(base_url=url) for url in urls])


def _answers(stack: Stack, name: str, timeout_s: float = 20.0) -> None:
    """One Generate call through `name` answers with the stub's text (retried while routes settle)."""
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            chunks = list(stub.Generate(pb.GenerateRequest(endpoint=name, kind=pb.REQUEST_KIND_CHAT,
                                                           body_json=chat_body(0)), timeout=10))
            break
        except grpc.RpcError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine-proxy does not answer for {name!r} within {timeout_s:.0f}s: "
                                   f"{exc}") from None
            time.sleep(0.1)
    if bg.STUB_TEXT.encode() not in chunks[0].data:
        raise RuntimeError(f"{name}: unexpected answer {chunks[0].data[:300]!r}")


def _idle_cpu_ms_per_s(pid: int, seconds: float = 5.0) -> float:
    time.sleep(1.0)                 # let the watchers of a new pool start
    before = bg.cpu_seconds(pid)
    time.sleep(seconds)
    return float(bg.cpu_seconds(pid) - before) * 1000 / seconds


@contextmanager
def bring_up(workdir: Path) -> Iterator[Parts]:
    with ExitStack() as parts:
        bg.say(f"starting Redis, two stubs and the five services (logs in {workdir})")
        with bg.deferred_interrupts():
            redis_server = start_redis(workdir / "redis")
            parts.callback(redis_server.proc.stop)
        stubs, pids = [], {}
        for i in range(2):
            port = free_port()
            proc = spawn(f"stub{i}", [sys.executable, str(BENCH / "stub_backend.py"), "--port", str(port)],
                            {}, workdir / f"stub{i}.log")
            parts.callback(proc.stop)
            stubs.append(f"http://127.0.0.1:{port}")
            wait_http(stubs[-1] + "/health", 15, proc)
            pids[f"stub{i}"] = proc.pid
        stack = parts.enter_context(running_stack(workdir / "stack", redis_server))
        # Scrapes and probes run per second, not per request, in every phase alike: measured apart
        # as the idle CPU engine-proxy spends once the two pools exist against before.
        idle = []
        for pools in (False, True):
            _register(stack, stubs, pools)
            for name, _, n in ROUTES.values():
                if (n > 1) == pools:
                    _answers(stack, name)
            idle.append(_idle_cpu_ms_per_s(stack.procs["engine-proxy"].pid))
        loadgen = GrpcLoadGen()
        parts.callback(loadgen.close)
        pids.update({"engine-proxy": stack.procs["engine-proxy"].pid, "client": loadgen.pid})
        try:
            yield Parts(stack, stubs, loadgen, pids, idle[1] - idle[0])
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------------------------
# Measuring


def measure(parts: Parts, label: str, profile: Profile, rate: float) -> dict[str, Any]:
    name = ROUTES[label][0]
    spec = {"addr": parts.stack.ports.addr("engine-proxy"), "token": parts.stack.tokens.operator_token,
            "endpoint": name, "concurrency": 32, "requests": profile.requests, "warmup": profile.warmup,
            "max_seconds": profile.max_seconds, "rate": rate}
    before = [bg.stub_stats(url)["requests"] for url in parts.stubs]
    res: dict[str, Any] = parts.loadgen.measure(spec, parts.pids, parts.stubs[0])
    after = [bg.stub_stats(url)["requests"] for url in parts.stubs]
    served = [a - b for a, b in zip(after, before, strict=True)]
    res["replica_share"] = [s / max(sum(served), 1) for s in served]   # warm-up included
    if res["errors"]:
        bg.say(f"warning: {label}: {res['errors']} failed requests, first: {res['first_error']}")
    return res


Rounds = list[dict[str, dict[str, Any]]]


def modes(rate: float) -> dict[str, float]:
    """Closed loop: 32 requests always in flight (the issue's condition); paced: the same 32 clients
    offering `rate` requests a second together, which every endpoint sustains whatever else runs."""
    return {"32 in flight": 0.0, f"paced {rate:g}/s": rate}


def run(parts: Parts, profile: Profile, rate: float) -> dict[str, Rounds]:
    labels = list(ROUTES)
    results: dict[str, Rounds] = {mode: [] for mode in modes(rate)}
    for r in range(profile.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for mode, offered in modes(rate).items():
            one: dict[str, dict[str, Any]] = {}
            for label in order:
                bg.say(f"round {r + 1}/{profile.rounds}  {mode:<13} {label:<12} {profile.requests} requests")
                one[label] = measure(parts, label, profile, offered)
            results[mode].append(one)
    return results


def pick_cost_us(n: int = 20_000) -> dict[str, float]:
    """The policy code alone, in this process: affinity_key + Router.pick on the bench's bodies (µs)."""
    bodies = [json.loads(chat_body(i)) for i in range(32)]
    replicas = [CandidateState("r0", running=3, metrics_at=time.monotonic()),
                CandidateState("r1", running=2, metrics_at=time.monotonic())]
    out = {}
    for label, (_, policy, _) in ROUTES.items():
        router = Router(policy, [r.id for r in replicas])
        now = time.monotonic()
        t0 = time.perf_counter()
        for i in range(n):
            router.pick(replicas, affinity_key(policy, pb.REQUEST_KIND_CHAT, bodies[i % 32], ""), now)
        out[label] = (time.perf_counter() - t0) / n * 1e6
    return out


def _cpu(res: dict[str, Any]) -> float:
    return float(res["cpu_ms_per_request"]["engine-proxy"])


def report(results: dict[str, Rounds], profile_name: str, in_process: dict[str, float], background: float) -> str:
    rounds_n = len(next(iter(results.values())))
    lines = [f"\nRouting cost ({profile_name} run, {rounds_n} rounds; 32 gRPC Generate clients straight to "
             "engine-proxy, endpoints measured in rotating order; stub backends; medians over rounds)\n"]
    head = (f"{'load':<13} {'endpoint':<12} {'replicas':>8} {'req/s':>7} {'p50 ms':>7} "
            f"{'engine-proxy CPU ms/req':>24} {'added':>7} {'share r0/r1':>12} {'busy*':>6}")
    lines += [head, "-" * len(head)]
    verdicts, single_stub = [], False
    for mode, rounds in results.items():
        def med(label: str, field: str, index: int = -1, rounds: Rounds = rounds) -> float:
            return statistics.median(float(r[label][field] if index < 0 else r[label][field][index])
                                     for r in rounds)

        for label, (_, _, n) in ROUTES.items():
            deltas = [_cpu(r[label]) - _cpu(r["one replica"]) for r in rounds]
            added = statistics.median(deltas)
            single_stub |= n > 1 and max(med(label, "replica_share", 0), med(label, "replica_share", 1)) > 0.99
            lines.append(f"{mode if label == 'one replica' else '':<13} {label:<12} {n:>8} {med(label, 'rps'):>7.0f} "
                         f"{med(label, 'p50_ms'):>7.2f} {statistics.median(_cpu(r[label]) for r in rounds):>24.3f} "
                         f"{'' if label == 'one replica' else f'{added:+.3f}':>7} "
                         f"{med(label, 'replica_share', 0):>7.2f}/{med(label, 'replica_share', 1):.2f} "
                         f"{max(r[label]['foreign_cpu_cores'] for r in rounds):>6.2f}")
            per_round = f"per round {', '.join(f'{d:+.3f}' for d in deltas)}"
            if n > 1:
                verdicts.append(f"  {mode}, {label}: {added:+.3f} ms CPU/request against one replica "
                                f"(budget ≤ {BUDGET_MS} ms: {'within' if added <= BUDGET_MS else 'OVER'}; {per_round})")
            elif label == "control":
                verdicts.append(f"  {mode}, noise floor (control, also one replica): {added:+.3f} ({per_round})")
        lines.append("")
    lines += verdicts
    rates = {mode: statistics.median(float(r["least-load"]["rps"]) for r in rounds) for mode, rounds in results.items()}
    lines.append(f"  background of the two pools (/metrics scrapes, probes), idle: {background:+.2f} ms CPU/s, "
                 "in every row alike; per request of one pool: "
                 + ", ".join(f"{mode} {background / 2 / rps:+.3f} ms" for mode, rps in rates.items()))
    lines.append("  policy code alone, in process (affinity_key + pick, two replicas): "
                 + ", ".join(f"{label} {us:.1f} µs" for label, us in in_process.items() if label != "one replica"))
    lines.append("  * busy: CPUs that processes other than the benchmark's kept busy (above ~0.15 the closed-loop "
                 "numbers move with it: trust the paced ones, or run again on an idle machine)")
    if single_stub:
        lines.append("  NOTE: a two-replica endpoint sent everything to one stub: engine-proxy does not route "
                     "over the pool yet, so its added cost is not the routing's")
    return "\n".join(lines)


def _measure(workdir: Path, profile_name: str, rate: float) -> tuple[str, dict[str, Any]]:
    with bring_up(workdir) as parts:
        rounds = run(parts, PROFILES[profile_name], rate)
        background = parts.background_ms_per_s
        bg.say("stopping everything")
    return report(rounds, profile_name, pick_cost_us(), background), {"rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = bg.bench_parser(__doc__, "a ~1.5 min run with fewer requests")
    ap.add_argument("--rate", type=float, default=RATE,
                    help=f"requests per second the 32 clients offer together in the paced phases "
                         f"(default {RATE:g})")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the load generator child
    args = ap.parse_args(argv)
    if args.client:
        asyncio.run(serve(_client_phase))
        return 0
    return bg.run_bench(args, "examlops-bench-routing-",
                        lambda workdir, profile_name: _measure(workdir, profile_name, args.rate))


if __name__ == "__main__":
    sys.exit(main())
