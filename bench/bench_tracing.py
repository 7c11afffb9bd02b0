"""Tracing cost: the latency and CPU a call pays with tracing on, and with it off, in one run.

    .venv/bin/python bench/bench_tracing.py            # ~3 min
    .venv/bin/python bench/bench_tracing.py --quick    # ~1 min
    .venv/bin/python bench/bench_tracing.py --json out.json

Starts Redis, the stub backend (bench/stub_backend.py), a real OTLP/HTTP receiver in this process
(examlops_testsupport.otlp: it decodes every export) and three stacks of the five services on that
Redis, each with the endpoint `bench` on the stub:

- `unset`: no OTEL_* variable (what every deployment without a collector runs: nothing installed);
- `disabled`: an OTLP endpoint but OTEL_SDK_DISABLED=true (the SDK switched off by its own variable);
- `on`: exporting to the receiver over OTLP/HTTP (BatchSpanProcessor, its default schedule).

One client (bench/loadgen.py, its own process) sends sequential chat requests through each gateway,
non-streaming and streaming, in interleaved rounds (the order rotates each round, so drift of the
machine hits every stack alike). Per stack: the median over rounds of p50 and p99, the difference
from `unset`, and gateway + engine-proxy CPU per request (/proc/<pid>/stat around the measured
requests). Budget (issue 14): `on` adds at most 0.3 ms p50; `disabled` - `unset` is the run's noise
floor for "off costs nothing" (both run the same code: no provider, no interceptor, no header).
"""

from __future__ import annotations

import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402

from examlops.svc import DEFAULT_ADMIN_KEY  # noqa: E402
from examlops_devstack import free_port, spawn, wait_http  # noqa: E402
from examlops_testsupport.fixtures import running_stack, start_redis  # noqa: E402
from examlops_testsupport.otlp import OtlpReceiver  # noqa: E402

BUDGET_MS = 0.3
STACKS = ("unset", "disabled", "on")
PROFILES = {"full": {"rounds": 8, "requests": 400, "warmup": 50},
            "quick": {"rounds": 3, "requests": 200, "warmup": 30}}
# engine-proxy's span of a call: Generate for a stream, GenerateOnce for a whole answer
GENERATE = ("examlops.engine_proxy.v1.EngineProxy/Generate", "examlops.engine_proxy.v1.EngineProxy/GenerateOnce")
CHAT = "POST /v1/chat/completions"  # the gateway's


def engine_spans(otlp: OtlpReceiver) -> int:
    return sum(len(otlp.spans(name)) for name in GENERATE)


def stack_env(name: str, otlp: OtlpReceiver) -> dict[str, str]:
    exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    return {"unset": {}, "disabled": {**exporting, "OTEL_SDK_DISABLED": "true"}, "on": exporting}[name]


def measure(workdir: Path, profile_name: str) -> tuple[str, dict[str, Any]]:
    profile = PROFILES[profile_name]
    with ExitStack() as parts:
        bg.say(f"starting Redis, the stub, an OTLP receiver and three stacks (logs in {workdir})")
        redis_server = start_redis(workdir / "redis")
        parts.callback(redis_server.proc.stop)
        stub_url = f"http://127.0.0.1:{free_port()}"
        stub = spawn("stub", [sys.executable, str(BENCH / "stub_backend.py"), "--port", stub_url.rsplit(":", 1)[1]],
                     {}, workdir / "stub.log")
        parts.callback(stub.stop)
        wait_http(stub_url + "/health", 15, stub)
        otlp = parts.enter_context(OtlpReceiver("http/protobuf"))
        stacks = {}
        for name in STACKS:
            stack = parts.enter_context(running_stack(workdir / name, redis_server, stack_env(name, otlp)))
            stacks[name] = stack
        stacks["unset"].register(bg.ENDPOINT, engine="vllm-server", base_url=stub_url)  # one registry store
        for name, stack in stacks.items():
            bg.check_with_openai(stack.gateway_url, name)
        loadgen = bg.LoadGen()
        parts.callback(loadgen.close)
        otlp.wait_for(lambda spans: any(s.name in GENERATE for s in spans))
        otlp.clear()

        rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(profile["rounds"]):
            order = STACKS[r % 3:] + STACKS[:r % 3]
            for stream in (False, True):
                for name in order:
                    stack = stacks[name]
                    pids = {"gateway": stack.procs["gateway"].pid, "engine-proxy": stack.procs["engine-proxy"].pid}
                    res = loadgen.chat(stack.gateway_url, DEFAULT_ADMIN_KEY, stream, 1,
                                       (profile["requests"], profile["warmup"], 30), pids, stub_url)
                    if res["errors"]:
                        raise RuntimeError(f"{name}: {res['errors']} failed requests, first: {res['first_error']}")
                    rows.setdefault((name, "stream" if stream else "non-stream"), []).append(res)
            bg.say(f"round {r + 1}/{profile['rounds']} done; {engine_spans(otlp)} engine-proxy call spans received")
        calls = profile["rounds"] * 2 * (profile["requests"] + profile["warmup"])
        received = engine_spans(otlp)
        if received < calls:  # the last batch may still be in flight: give it the exporter's schedule
            otlp.wait_for(lambda spans: sum(s.name in GENERATE for s in spans) >= calls, timeout=15)
        # the call's own spans (background RPCs of the stack, e.g. price refreshes, are not per call)
        spans = engine_spans(otlp) + len(otlp.spans(CHAT, service="gateway"))
        bg.say("stopping everything")
    return report(rows, spans / calls, profile_name), {"rows": {f"{k[0]}/{k[1]}": v for k, v in rows.items()},
                                                        "spans_per_traced_call": spans / calls}


def report(rows: dict[tuple[str, str], list[dict[str, Any]]], spans_per_call: float, profile: str) -> str:
    def med(name: str, shape: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[(name, shape)])

    def cpu(name: str, shape: str) -> float:
        return statistics.median(sum(r["cpu_ms_per_request"].values()) for r in rows[(name, shape)])

    out = [f"Tracing cost, 1 client, sequential requests through the gateway ({profile} profile, "
           f"{len(rows[('unset', 'non-stream')])} interleaved rounds; medians over rounds)", "",
           f"{'shape':<11} {'stack':<9} {'p50 ms':>8} {'p99 ms':>8} {'Δp50 ms':>8} {'Δp99 ms':>8} "
           f"{'CPU ms/req':>10} {'ΔCPU':>7}"]
    verdicts = []
    for shape in ("non-stream", "stream"):
        base50, base99, base_cpu = med("unset", shape, "p50_ms"), med("unset", shape, "p99_ms"), cpu("unset", shape)
        for name in STACKS:
            p50, p99, c = med(name, shape, "p50_ms"), med(name, shape, "p99_ms"), cpu(name, shape)
            out.append(f"{shape:<11} {name:<9} {p50:8.3f} {p99:8.3f} {p50 - base50:+8.3f} {p99 - base99:+8.3f} "
                       f"{c:10.3f} {c - base_cpu:+7.3f}")
        added = med("on", shape, "p50_ms") - base50
        floor = med("disabled", shape, "p50_ms") - base50
        verdicts.append(f"{shape}: tracing on adds {added:+.3f} ms p50 (budget {BUDGET_MS} ms: "
                        f"{'within' if added <= BUDGET_MS else 'OVER'}); off (disabled vs unset) {floor:+.3f} ms, "
                        "the run's noise floor")
    out += ["", *verdicts,
            f"spans exported per traced call (gateway + engine-proxy): {spans_per_call:.2f}, received and decoded"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = bg.bench_parser(__doc__, "three rounds of 200 requests").parse_args(argv)
    return bg.run_bench(args, "examlops-bench-tracing-", measure)


if __name__ == "__main__":
    sys.exit(main())
