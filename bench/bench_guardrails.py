"""Guardrail cost on the request path, in process (the stage objects the gateway runs, no network):

    .venv/bin/python bench/bench_guardrails.py

1. input scan: GuardStage.check_input on a 2 KB chat prompt (clean, so nothing is blocked) with every
   built-in CPU detector (pii, secrets, regex) in one policy, against no policy (the dict lookup);
2. streaming: the time GuardedCall adds before the first chunk can be sent (added TTFT) with an
   output policy of the same detectors, and per chunk over a 2,000-chunk answer; the longest single
   read (what the event loop is held for, target < 5 ms).
Prints p50/p99 in ms and the targets (input ≤ 2 ms p50, streaming TTFT < 3 ms added).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops_gateway.governance import Caller, Ticket
from examlops_gateway.guardrails import GuardedCall, GuardrailBook, GuardStage, build_rules, parse_policy

ALL = {"detectors": [{"detector": d, "direction": "both", "action": "redact"} for d in ("pii", "secrets")]
       + [{"detector": "regex", "pattern": r"ACME-\d{4}", "direction": "both", "action": "block"}]}
WORDS = ["the", "quarterly", "report", "shows", "steady", "growth", "in", "the", "northern", "region", "with",
         "orders", "up", "4.2", "percent"]


def _prompt(size: int = 2048) -> bytes:
    text = ""
    i = 0
    while len(text) < size:
        text += WORDS[i % len(WORDS)] + " "
        i += 1
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text[:size]}]})


def _book(with_policy: bool) -> GuardrailBook:
    async def ask(route: str, body: bytes, timeout_s: float) -> bytes:
        raise RuntimeError("no judge in this bench")
    book = GuardrailBook(None, ask)  # type: ignore[arg-type]
    if with_policy:
        book.rules = {"all": build_rules(parse_policy("all", ALL), ask)}
        book.endpoints = {"m": ("all",)}
    return book


def _ticket(body: bytes, stream: bool = False) -> Ticket:
    return Ticket(gov=None, caller=Caller("admin"), res_id="", model="m", body=body, stream=stream,  # type: ignore[arg-type]
                  price=None, prompt_bound=0, max_tokens=0, n=1, reserved_micro=0, project="", started=0.0)


def _pct(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {statistics.median(xs) * 1000:.3f} ms  p99 {xs[int(len(xs) * 0.99)] * 1000:.3f} ms"


async def bench_input(n: int = 500) -> None:
    body = _prompt()
    for label, stage in (("no policy", GuardStage(_book(False))), ("pii+secrets+regex", GuardStage(_book(True)))):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await stage.check_input(_ticket(body))
            times.append(time.perf_counter() - t)
        print(f"input scan, 2 KB prompt, {label:18s}: {_pct(times)}")


class _Call:
    def __init__(self, chunks: list[pb.GenerateChunk]) -> None:
        self.chunks = iter(chunks)

    async def read(self) -> Any:
        return next(self.chunks)

    def cancel(self) -> bool:
        return True


def _chunks(n: int) -> list[pb.GenerateChunk]:
    out = []
    for i in range(n):
        delta = {"content": " " + WORDS[i % len(WORDS)], **({"role": "assistant"} if i == 0 else {})}
        obj = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if i == n - 1 else None}]}
        out.append(pb.GenerateChunk(data=orjson.dumps(obj), usage=pb.Usage(prompt_tokens=3, completion_tokens=i + 1)))
    return [*out, pb.GenerateChunk(final=True)]


async def bench_stream(n: int = 300, length: int = 2000) -> None:
    stage = GuardStage(_book(True))
    ttft, per_chunk, longest = [], [], 0.0
    for i in range(n):
        ticket = _ticket(_prompt(64), stream=True)
        guard = await stage.check_input(ticket)
        assert guard is not None
        chunks = _chunks(length if i < 3 else 2)
        call = GuardedCall(_Call(chunks), guard, ticket)
        t = time.perf_counter()
        await call.read()
        ttft.append(time.perf_counter() - t)
        if i < 3:  # three long answers: the per-chunk cost and the longest hold of the loop
            for _ in range(len(chunks) - 1):
                t = time.perf_counter()
                await call.read()
                took = time.perf_counter() - t
                per_chunk.append(took)
                longest = max(longest, took)
    print(f"streaming, added time to the first chunk         : {_pct(ttft)}  (target < 3 ms)")
    print(f"streaming, per chunk over 3 x {length} chunks      : {_pct(per_chunk)}; "
          f"longest read {longest * 1000:.2f} ms (event loop target < 5 ms)")


async def main() -> None:
    _book(True)  # warm Presidio's recognizers before timing
    await GuardStage(_book(True)).check_input(_ticket(_prompt()))
    await bench_input()
    print("target: the input scan with every built-in detector adds at most 2 ms p50")
    await bench_stream()


if __name__ == "__main__":
    asyncio.run(main())
