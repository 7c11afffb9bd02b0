"""The load of `exa serve llm bench`: streamed chat requests at a fixed concurrency, timed per token.

Each request is timed on the client from just before it is sent:
- TTFT: until the first streamed chunk that carries text (vLLM sends its role chunk with it);
- inter-token latency (ITL): the gaps between successive chunks that carry text (one token per chunk
  unless the server groups tokens: speculative decoding, vLLM's stream_interval);
- TPOT: (latency - TTFT) / (output tokens - 1), the mean time per output token after the first;
- latency: until the end of the stream.
Output tokens are the final usage chunk's completion_tokens (stream_options.include_usage), exact.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson

from ._bench_server import settled, snapshot
from .gateway import error_line

#: Common English words that BPE tokenizers (GPT-2, Llama, SmolLM2, Qwen…) keep as one token each
#: after a space: a prompt of N of them is about N tokens.
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
          "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
          "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
          "when", "will", "would", "who", "so", "no")

_JSON = {"Content-Type": "application/json"}


def synthetic_prompt(tokens: int, run: str, index: int) -> str:
    """About `tokens` tokens: a head unique to the run and request, then random one-token words.

    The unique head makes every prompt differ from its first tokens, so no request reuses another's
    cached prefix (only the chat template's own preamble can be a prefix-cache hit). The head is
    counted as one token per character, an upper bound for digits and hex.
    """
    head = f"{run}-{index:05d}:"
    rng = random.Random(f"{run}:{index}")
    return " ".join([head, *(rng.choice(_WORDS) for _ in range(max(tokens - len(head), 1)))])


@dataclass(frozen=True)
class Target:
    """Where requests go: the chat-completions URL, its headers and the model name it expects."""

    url: str
    headers: dict[str, str]
    model: str


@dataclass(frozen=True)
class LoadSpec:
    targets: list[Target]
    concurrency: int
    requests: int
    warmup: int
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    timeout_s: float
    servers: list[str] = field(default_factory=list)  # vLLM servers whose /metrics frame the run (_bench_server)


@dataclass
class Sample:
    """One request's timings (seconds from its send) and usage; `error` set when it failed."""

    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    exact_tokens: bool = False


class FirstRequestFailed(Exception):
    """Every request so far failed: the run stops on the first error instead of repeating it."""


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


async def one_request(client: httpx.AsyncClient, target: Target, body: bytes) -> Sample:
    """Send one streamed chat request and time its chunks."""
    sample = Sample()
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", target.url, content=body, headers=target.headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                sample.error = error_line(resp)
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = orjson.loads(data)
                if obj.get("error"):
                    sample.error = error_line(httpx.Response(200, content=data.encode()))  # an error mid-stream
                    return sample
                if any(_has_text(c) for c in obj.get("choices") or ()):
                    chunks += 1
                    if sample.ttft_s is None:
                        sample.ttft_s = now - t0
                    else:
                        sample.itl_s.append(now - last)
                    last = now
                usage = obj.get("usage")
                if usage:
                    sample.output_tokens = int(usage.get("completion_tokens") or 0)
                    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    sample.exact_tokens = True
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return sample
    sample.latency_s = time.perf_counter() - t0
    if not sample.exact_tokens:  # a server without include_usage: one token per text chunk
        sample.output_tokens = chunks
    if sample.ttft_s is None:
        sample.error = "the stream ended without any text"
    return sample


def request_body(spec: LoadSpec, target: Target, prompt: str) -> bytes:
    body: dict[str, Any] = {
        "model": target.model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": spec.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return orjson.dumps(body)


async def run_phase(client: httpx.AsyncClient, spec: LoadSpec, run: str, indices: range,
                    advance: Callable[[Sample], None]) -> tuple[list[Sample], float]:
    """Requests `indices` at spec.concurrency; (samples, wall seconds from the first send to the last end)."""
    pending = iter(indices)
    samples: list[Sample] = []

    async def worker() -> None:
        for i in pending:
            target = spec.targets[i % len(spec.targets)]
            sample = await one_request(client, target, request_body(spec, target, synthetic_prompt(
                spec.prompt_tokens, run, i)))
            samples.append(sample)
            advance(sample)
            if sample.error and all(s.error for s in samples):
                raise FirstRequestFailed(sample.error)

    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(spec.concurrency, len(indices))):
                group.create_task(worker())
    except* FirstRequestFailed as failed:
        raise failed.exceptions[0] from None
    return samples, time.perf_counter() - t0


@dataclass
class Run:
    """The measured requests' samples and wall seconds; the servers' series just before and after them."""

    samples: list[Sample]
    wall_s: float
    before: list[dict[str, float]] | str  # or why the servers were not read
    after: list[dict[str, float]] | str


async def run_load(spec: LoadSpec, advance: Callable[[str, Sample], None]) -> Run:
    """The warm-up (not measured), then the measured requests, framed by the servers' /metrics."""
    run = f"{random.getrandbits(32):08x}"
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    timeout = httpx.Timeout(spec.timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=_JSON) as client:
        before = await snapshot(client, spec.servers) if spec.servers else "not read"
        read = not isinstance(before, str)  # servers not read before the run are not read (or waited on) again
        if spec.warmup:
            await run_phase(client, spec, run, range(spec.requests, spec.requests + spec.warmup),
                            lambda s: advance("warmup", s))
            if read:
                before = await settled(client, spec.servers, before)
        samples, wall_s = await run_phase(client, spec, run, range(spec.requests), lambda s: advance("bench", s))
        after = await settled(client, spec.servers, before) if read else before
        return Run(samples, wall_s, before, after)


def distribution_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    ms = np.asarray(values_s) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "min": float(ms.min()), "max": float(ms.max())}


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The report's numbers: counts, throughput over the wall time, and the latency distributions."""
    ok = [s for s in samples if not s.error]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    output = sum(s.output_tokens for s in ok)
    return {
        "completed": len(ok), "failed": len(samples) - len(ok),
        "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5]],
        "duration_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens": output,
        "output_tokens_per_s": output / wall_s if wall_s else 0.0,
        "output_tokens_exact": all(s.exact_tokens for s in ok),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "prompt_tokens_mean": sum(s.prompt_tokens for s in ok) / len(ok) if ok else 0.0,
        "ttft_ms": distribution_ms([s.ttft_s for s in ok if s.ttft_s is not None]),
        "itl_ms": distribution_ms([gap for s in ok for gap in s.itl_s]),
        "tpot_ms": distribution_ms([(s.latency_s - (s.ttft_s or 0.0)) / (s.output_tokens - 1)
                                    for s in ok if s.output_tokens > 1]),
        "latency_ms": distribution_ms([s.latency_s for s in ok]),
    }
