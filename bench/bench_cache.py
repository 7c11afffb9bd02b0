"""Response-cache cost: an exact hit through the gateway, a semantic lookup over 10,000 entries, and
(optionally) a hit against real SmolLM2 generation.

    .venv/bin/python bench/bench_cache.py             # ~1 min
    .venv/bin/python bench/bench_cache.py --quick     # ~30 s
    .venv/bin/python bench/bench_cache.py --smol      # also real SmolLM2 on CPU vLLM (+ ~1 min)

1. Exact hit, same parts and load generator as bench_gateway.py (Redis, the five services, the fast
   stub behind the endpoint `bench`), admin key, 1 client, a deterministic request (temperature 0):
   the stub called directly, the gateway without a cache policy (its cost: gateway minus direct),
   then with an exact policy on `bench`, where every measured request is a hit that never reaches
   engine-proxy. Target: a hit costs at most 1 ms p50 more than the uncached path's gateway cost.
2. Semantic lookup, in process: a SemanticIndex (the gateway's) over 10,000 entries of 384-dim unit
   vectors in one space (the worst case: every entry compared), on the same Redis; the lookup plus
   the GET of the answer it points at, which is what a semantic hit costs beyond the embedding call.
   Target: at most 2 ms p50.
3. --smol: SmolLM2-135M on the real CPU vLLM behind the gateway, an exact policy; the time of a
   generation (a miss, 64 tokens) against a hit of the same request, with the official openai client.
   Target: a hit at least 20x faster.
Prints the numbers and the ratios; nothing here is a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_gateway as bg  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from examlops.svc import DEFAULT_ADMIN_KEY  # noqa: E402
from examlops_devstack import free_port  # noqa: E402
from examlops_gateway.cache import SemanticIndex  # noqa: E402
from examlops_gateway.cache._store import entry_key  # noqa: E402
from examlops_testsupport.fixtures import Stack, start_redis  # noqa: E402

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
PROFILES = {"full": (1000, 100, 10.0), "quick": (300, 50, 5.0)}  # requests, warm-up, max seconds per phase


def _body(stream: bool) -> str:
    body = json.loads(bg.request_body(stream))
    body["temperature"] = 0
    return json.dumps(body, separators=(",", ":"))


def _policy(stack: Stack, model: str, mode: str | None) -> None:
    """Set the model's cache policy (None: remove it) and wait until the gateway applied it."""
    url = stack.gateway_url + "/admin/cache/policies"
    if mode is None:
        resp = httpx.delete(url, headers=ADMIN, params={"model": model})
    else:
        resp = httpx.put(url, headers=ADMIN, json={"model": model, "mode": mode})
    resp.raise_for_status()
    deadline = time.monotonic() + 10
    while True:
        listing = httpx.get(stack.gateway_url + "/admin/cache/policies", headers=ADMIN).json()
        if listing["version"] == listing["applied"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not apply the cache policy within 10 s")
        time.sleep(0.1)


def _p50(parts: bg.Parts, url: str, stream: bool, profile: tuple[int, int, float]) -> float:
    res = parts.loadgen.chat(url, DEFAULT_ADMIN_KEY, stream, 1, profile, parts.pids, parts.stub_url, _body(stream))
    return float(res["p50_ms"])


def bench_exact(workdir: Path, profile: tuple[int, int, float]) -> list[str]:
    lines = []
    with bg.bring_up(workdir) as parts:
        stack = parts.stack
        for stream in (False, True):
            kind = "stream" if stream else "non-stream"
            bg.say(f"exact, {kind}: direct, gateway without a policy")
            direct = _p50(parts, parts.stub_url, stream, profile)
            uncached = _p50(parts, stack.gateway_url, stream, profile)
            _policy(stack, bg.ENDPOINT, "exact")
            # a first call fills the cache; the warm-up and every measured request then hit
            httpx.post(stack.gateway_url + bg.CHAT_PATH, headers=ADMIN, content=_body(stream)).raise_for_status()
            time.sleep(0.3)
            check = httpx.post(stack.gateway_url + bg.CHAT_PATH, headers=ADMIN, content=_body(stream))
            if check.headers.get("x-examlops-cache") != "hit-exact":
                raise RuntimeError(f"expected a hit, got {check.headers.get('x-examlops-cache')!r}")
            bg.say(f"exact, {kind}: gateway, every request a hit")
            hit = _p50(parts, stack.gateway_url, stream, profile)
            _policy(stack, bg.ENDPOINT, None)  # the next kind's uncached run must not hit
            cost = uncached - direct
            lines.append(f"exact hit, {kind:<10}: direct {direct:.3f} ms, gateway uncached {uncached:.3f} ms "
                         f"(gateway cost {cost:.3f} ms), hit {hit:.3f} ms -> added over the gateway cost "
                         f"{hit - cost:+.3f} ms p50 (target <= 1 ms); hit / uncached = {hit / uncached:.2f}")
    return lines


async def bench_semantic(workdir: Path, entries: int = 10_000, lookups: int = 2000, dim: int = 384) -> list[str]:
    server = start_redis(workdir / "redis-semantic")
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        index = SemanticIndex(client, max_entries=entries + 10, sync_interval_s=0.25)
        await index.start()
        rng = np.random.default_rng(7)
        vectors = rng.standard_normal((entries, dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        space = "bench|" + secrets.token_hex(8)
        bg.say(f"semantic: adding {entries} entries")
        for i in range(entries):
            await index.add(space, vectors[i], f"e{i}", 3600)
            if i < lookups:
                await client.set(entry_key("semantic", "bench", f"e{i}"), '{"answer": 1}', ex=3600)
        probes = vectors[:lookups] + 0.01 * rng.standard_normal((lookups, dim)).astype(np.float32)
        probes /= np.linalg.norm(probes, axis=1, keepdims=True)
        only, whole, hits = [], [], 0
        for probe in probes:
            t = time.perf_counter()
            best = index.lookup(space, probe, 0.95)
            only.append(time.perf_counter() - t)
            if best is not None:
                hits += 1
                await client.get(entry_key("semantic", "bench", best[0]))
            whole.append(time.perf_counter() - t)
        await index.aclose()
    finally:
        await client.aclose()
        server.proc.stop()
    return [f"semantic lookup over {entries} entries ({dim} dims, one space): index.lookup p50 "
            f"{statistics.median(only) * 1000:.3f} ms, p99 {sorted(only)[int(len(only) * 0.99)] * 1000:.3f} ms; "
            f"with the GET of the answer p50 {statistics.median(whole) * 1000:.3f} ms (target <= 2 ms); "
            f"{hits}/{lookups} near-duplicate probes hit"]


def bench_smol(workdir: Path, rounds: int = 5) -> list[str]:
    from examlops_testsupport.vllm import smol_block, start_vllm

    with bg.bring_up(workdir) as parts:
        stack = parts.stack
        port = free_port()
        bg.say("starting SmolLM2 on the CPU vLLM")
        proc = start_vllm(workdir, port, smol_block())
        try:
            stack.register("smol-bench", engine="vllm-server", base_url=f"http://127.0.0.1:{port}",
                           served_model_name="smol")
            time.sleep(1.5)
            _policy(stack, "smol-bench", "exact")
            c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
            gen: list[float] = []
            hit: list[float] = []
            for i in range(rounds):
                messages: Any = [{"role": "user", "content": f"Write a short poem about the number {i}."}]
                for times in (gen, hit):
                    t = time.perf_counter()
                    resp = c.chat.completions.with_raw_response.create(model="smol-bench", messages=messages,
                                                                       max_tokens=64, temperature=0)
                    times.append(time.perf_counter() - t)
                    want = "miss" if times is gen else "hit-exact"
                    if resp.headers.get("x-examlops-cache") != want:
                        raise RuntimeError(f"expected {want}, got {resp.headers.get('x-examlops-cache')!r}")
                    time.sleep(0.2)  # the miss's answer is kept in the background
        finally:
            proc.stop()
    g, h = statistics.median(gen) * 1000, statistics.median(hit) * 1000
    return [f"SmolLM2-135M (CPU vLLM, 64 tokens): generation p50 {g:.1f} ms, hit p50 {h:.2f} ms -> "
            f"a hit is {g / h:.0f}x faster (target >= 20x)"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--smol", action="store_true", help="also a hit against real SmolLM2 generation (needs vLLM)")
    args = ap.parse_args(argv)
    profile = PROFILES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="examlops-bench-cache-") as tmp:
        workdir = Path(tmp)
        lines = bench_exact(workdir / "exact", profile)
        lines += asyncio.run(bench_semantic(workdir))
        if args.smol:
            lines += bench_smol(workdir / "smol")
    print("\nResponse cache (2-core machine numbers in services/gateway/CACHE.md)")
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
