"""Gateway overhead: the same stub backend called directly and through the whole stack, in one run.

    .venv/bin/python bench/bench_gateway.py            # ~1.5 min
    .venv/bin/python bench/bench_gateway.py --quick    # ~30 s
    .venv/bin/python bench/bench_gateway.py --json out.json

Starts Redis, the five services (tests/_fixtures.py) and bench/stub_backend.py, registers the
endpoint `bench` (engine vllm-server, base_url = the stub), checks both paths with the official
openai client, then drives each path with the same load generator (bench/loadgen.py, its own
process): 1 client (latency over sequential requests) and 32 clients (throughput over a fixed
number of requests), non-streaming and streaming (time to last byte). It prints the latency the
gateway adds, the throughput ratio and the CPU each server process spent per request (from
/proc/<pid>/stat), and compares them with the performance budget of ARCHITECTURE.md.
Everything listens on 127.0.0.1 and everything it started is stopped at the end, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402
from _report import report  # noqa: E402

from examlops.svc import DEFAULT_ADMIN_KEY  # noqa: E402
from examlops_devstack import Proc, free_port, spawn, wait_http  # noqa: E402
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis  # noqa: E402

ENDPOINT = "bench"
CHAT_PATH = "/v1/chat/completions"
STUB_TEXT = "Hello from the stub."
MESSAGES = [{"role": "user", "content": "Say hello in five words."}]


@dataclass(frozen=True)
class Profile:
    latency_requests: int    # sequential requests at 1 client
    latency_warmup: int
    throughput_requests: int  # requests spread over 32 clients
    throughput_warmup: int
    max_seconds: float       # cap of one measured phase (and of its warm-up)


PROFILES = {
    "full": Profile(latency_requests=2000, latency_warmup=200, throughput_requests=10_000,
                    throughput_warmup=1000, max_seconds=20),
    "quick": Profile(latency_requests=300, latency_warmup=50, throughput_requests=1500,
                     throughput_warmup=200, max_seconds=6),
}


def say(msg: str) -> None:
    sys.stderr.write(f"==> {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# CPU accounting

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs), from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    snap["machine"] = machine_busy_seconds()
    return snap


# ---------------------------------------------------------------------------------------------
# The load generator process


class LoadGen:
    """bench/loadgen.py as a child process in its own session (Ctrl-C reaches only us)."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(BENCH / "loadgen.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"load generator silent for {timeout_s:.0f}s") from None
        if not line:
            raise RuntimeError(f"load generator exited with {self.popen.wait()}")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("event") == "failed":
            raise RuntimeError(f"load generator failed: {msg['error']}")
        return msg

    def chat(self, url: str, api_key: str, stream: bool, clients: int, load: tuple[int, int, float],
             pids: dict[str, int], stub_url: str, body: str | None = None, label: str = "") -> dict[str, Any]:
        """`measure` of the benchmark's chat request (or `body`) at `url`; `load`: (requests, warm-up
        requests, max seconds). Failed requests are reported, the result keeps their count."""
        requests, warmup, max_seconds = load
        spec = {"url": url, "path": CHAT_PATH, "body": body or request_body(stream), "api_key": api_key,
                "stream": stream, "concurrency": clients, "requests": requests, "warmup": warmup,
                "max_seconds": max_seconds}
        res = self.measure(spec, pids, stub_url)
        if res["errors"]:
            say(f"warning: {label}{res['errors']} failed requests, first: {res['first_error']}")
        return res

    def measure(self, spec: dict[str, Any], pids: dict[str, int], stub_url: str) -> dict[str, Any]:
        """Warm up, then run the measured requests; CPU of `pids` is sampled around that part only."""
        limit = 2 * float(spec["max_seconds"]) + 30
        self._send(json.dumps(spec))
        ready = self._receive(limit)
        if ready.get("warmup_errors"):
            say(f"warning: {ready['warmup_errors']} errors during warm-up, first: {ready['first_error']}")
        stats_before = stub_stats(stub_url)
        before = cpu_snapshot(pids)
        self._send("go")
        result = self._receive(limit)
        after = cpu_snapshot(pids)
        stats_after = stub_stats(stub_url)
        count = max(int(result["count"]), 1)
        # connections the stub accepted per measured request: ~0 when the caller pools them
        result["backend_connections_per_request"] = (stats_after["connections"] - stats_before["connections"]) / count
        result["cpu_ms_per_request"] = {n: (after[n] - before[n]) * 1000 / count for n in pids}
        # CPU that none of our processes used: another workload on the machine skews the numbers. Less
        # the clock tick's resolution (one tick per CPU and per process sampled), which alone would
        # read as a busy machine over a phase of a few milliseconds.
        ours = sum(after[n] - before[n] for n in pids)
        slack = (len(pids) + (os.cpu_count() or 1)) / _TICK
        foreign = after["machine"] - before["machine"] - ours - slack
        result["foreign_cpu_cores"] = max(0.0, foreign) / result["elapsed_s"]
        return result

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                self._send("quit")
            try:
                self.popen.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=3)


# ---------------------------------------------------------------------------------------------
# Bringing the parts up


def stub_stats(stub_url: str) -> dict[str, int]:
    with urllib.request.urlopen(stub_url + "/stats", timeout=5) as resp:
        stats: dict[str, int] = json.loads(resp.read())
    return stats


def request_body(stream: bool) -> str:
    body: dict[str, Any] = {"model": ENDPOINT, "messages": MESSAGES, "max_tokens": 16}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":"))


def check_with_openai(base_url: str, label: str, timeout_s: float = 20.0, api_key: str = DEFAULT_ADMIN_KEY) -> None:
    """Both request shapes through `base_url` with the official client; retried while routes settle."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=10)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = client.chat.completions.create(model=ENDPOINT, messages=MESSAGES)  # type: ignore[arg-type]
            break
        except (openai.NotFoundError, openai.APIConnectionError, openai.InternalServerError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no answer from {base_url} within {timeout_s:.0f}s: {exc}") from None
            time.sleep(0.1)
    assert resp.choices[0].message.content == STUB_TEXT, f"{label}: unexpected answer {resp}"
    assert resp.usage is not None and resp.usage.completion_tokens == 5, f"{label}: usage missing: {resp}"
    chunks = list(client.chat.completions.create(model=ENDPOINT, messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == STUB_TEXT, f"{label}: unexpected stream text {text!r}"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5, f"{label}: no usage chunk"
    client.close()


@dataclass
class Parts:
    stub_url: str
    stack: Stack
    loadgen: LoadGen
    pids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C/SIGTERM back until the block ends: for a start whose process we cannot stop before it returns."""
    pending: list[int] = []
    saved = {sig: signal.signal(sig, lambda signum, _frame: pending.append(signum))
             for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if pending:
        raise KeyboardInterrupt(f"signal {pending[0]}")


@contextlib.contextmanager
def bring_up(workdir: Path) -> Iterator[Parts]:
    with contextlib.ExitStack() as parts:
        say(f"starting two Redis (the registry's, the gateway's), the stub and the five services (logs in {workdir})")
        with deferred_interrupts():  # start_redis returns the process only once Redis answers
            redis_server: RedisServer = start_redis(workdir / "redis")
            parts.callback(redis_server.proc.stop)
            # the gateway's own Redis, as `make up` runs it (GOVERNANCE.md, Durability)
            gateway_redis: RedisServer = start_redis(workdir / "gateway-redis", fsync="everysec")
            parts.callback(gateway_redis.proc.stop)

        stub_port = free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        stub: Proc = spawn("stub", [sys.executable, str(BENCH / "stub_backend.py"), "--port", str(stub_port)],
                           {}, workdir / "stub.log")
        parts.callback(stub.stop)
        wait_http(stub_url + "/health", 15, stub)

        stack = parts.enter_context(running_stack(workdir / "stack", redis_server, gateway_redis=gateway_redis))
        stack.register(ENDPOINT, engine="vllm-server", base_url=stub_url)
        check_with_openai(stub_url, "stub")
        check_with_openai(stack.gateway_url, "gateway")
        say("the official openai client gets the same answers directly and through the gateway")

        loadgen = LoadGen()
        parts.callback(loadgen.close)
        pids = {"gateway": stack.procs["gateway"].pid, "engine-proxy": stack.procs["engine-proxy"].pid,
                "stub": stub.pid, "client": loadgen.pid}
        # the rest of the stack, summed as "other": nothing of it should be on the request path
        pids.update({f"other:{name}": stack.procs[name].pid for name in ("registry", "mediaguard", "launcher")})
        pids["other:redis"] = gateway_redis.proc.pid  # the one on the governed request path
        pids["other:registry-redis"] = redis_server.proc.pid
        try:
            yield Parts(stub_url, stack, loadgen, pids)
        finally:
            # a second Ctrl-C must not cut the teardown short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------------------------
# Measuring


def run_scenarios(parts: Parts, profile: Profile) -> list[dict[str, Any]]:
    results = []
    for stream in (False, True):
        for concurrency in (1, 32):
            one = concurrency == 1
            label = f"{'stream' if stream else 'non-stream'}, {concurrency} client{'' if one else 's'}"
            row: dict[str, Any] = {"scenario": label, "stream": stream, "concurrency": concurrency}
            load = (profile.latency_requests if one else profile.throughput_requests,
                    profile.latency_warmup if one else profile.throughput_warmup, profile.max_seconds)
            for target, url in (("direct", parts.stub_url), ("gateway", parts.stack.gateway_url)):
                say(f"{label:<22} {target:<8} {load[0]} requests")
                res = parts.loadgen.chat(url, DEFAULT_ADMIN_KEY, stream, concurrency, load, parts.pids,
                                         parts.stub_url)
                cpu = res["cpu_ms_per_request"]
                cpu["other"] = sum(v for k, v in cpu.items() if k.startswith("other:"))
                res["cpu_ms_per_request"] = {k: v for k, v in cpu.items() if not k.startswith("other:")}
                if res["count"] < load[0]:
                    say(f"note: phase capped at {profile.max_seconds:.0f}s after {res['count']} requests")
                row[target] = res
            results.append(row)
    return results


# ---------------------------------------------------------------------------------------------
# A run of a stack benchmark (this one, bench_governance, bench_routing)


def bench_parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The options every stack benchmark takes: --quick, --json and --workdir."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    ap.add_argument("--workdir", type=Path, help="keep logs and Redis data here (default: a temporary folder)")
    return ap


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


#: (workdir, profile name) -> (the report, the fields of the --json file besides "profile")
Measure = Callable[[Path, str], tuple[str, dict[str, Any]]]


def run_bench(args: argparse.Namespace, workdir_prefix: str, measure: Measure,
              errors: tuple[type[Exception], ...] = ()) -> int:
    """Run `measure` in a work folder, print its report and write --json. Ctrl-C and SIGTERM stop
    everything it started; the folder (its logs) is kept on failure or when --workdir names it.
    Exit status 0; 1 when it failed (RuntimeError, TimeoutError, AssertionError or `errors`);
    2 without redis-server; 130 when interrupted."""
    profile_name = "quick" if args.quick else "full"
    if shutil.which("redis-server") is None:
        say("redis-server is not installed (make system-deps installs it)")
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, _terminate)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=workdir_prefix))
    failures: tuple[type[Exception], ...] = (RuntimeError, TimeoutError, AssertionError, *errors)
    started = time.monotonic()
    ok = False
    try:
        text, fields = measure(workdir, profile_name)
        print(text)
        if args.json:
            args.json.write_text(json.dumps({"profile": profile_name, **fields}, indent=2))
        ok = True
    except KeyboardInterrupt:
        say("interrupted: everything it started is stopped")
        return 130
    except failures as exc:
        say(f"benchmark failed: {exc}\n    logs are in {workdir}")
        return 1
    finally:
        say(f"took {time.monotonic() - started:.0f}s")
        if ok and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _measure(workdir: Path, profile_name: str) -> tuple[str, dict[str, Any]]:
    with bring_up(workdir) as parts:
        results = run_scenarios(parts, PROFILES[profile_name])
        say("stopping everything")
    return report(results, profile_name), {"results": results}


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__, "a ~30 s run with fewer requests").parse_args(argv)
    signal.signal(signal.SIGHUP, _terminate)  # a closed terminal also stops everything cleanly
    return run_bench(args, "examlops-bench-", _measure)


if __name__ == "__main__":
    sys.exit(main())
