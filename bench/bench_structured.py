"""The gateway's cost of checking a structured answer: p50/p99 in microseconds of validating a typical
small answer against a small schema, beside parsing the same body alone (the baseline), in one run.

    .venv/bin/python bench/bench_structured.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from examlops_gateway.structured import StructuredOutput

SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"], "additionalProperties": False}}}
ANSWER = orjson.dumps({"id": "r", "object": "chat.completion", "created": 0, "model": "smol", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": '{"city": "Lyon", "population": 522000}'},
     "finish_reason": "stop"}], "usage": {"prompt_tokens": 30, "completion_tokens": 14, "total_tokens": 44}})


def timed(fn: object, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        fn()  # type: ignore[operator]
        out.append((time.perf_counter_ns() - t0) / 1000)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20_000)
    rounds = parser.parse_args().rounds
    shape = StructuredOutput.of(SCHEMA, chat=True, retries=1)
    assert shape is not None and shape.check_answer(ANSWER) is None
    schema = timed(lambda: StructuredOutput.of(SCHEMA, chat=True, retries=1), rounds // 10)
    base = timed(lambda: orjson.loads(ANSWER), rounds)
    check = timed(lambda: shape.check_answer(ANSWER), rounds)
    stream = shape.stream_check()
    chunk = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "522"}, "finish_reason": None}]})
    per_chunk = timed(lambda: stream.hold(chunk), rounds)

    def p(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    for name, xs in (("schema check at parse (seen before)", schema), ("parse the answer alone (baseline)", base),
                     ("check a whole answer", check), ("take in one stream chunk", per_chunk)):
        print(f"{name:36s} p50 {statistics.median(xs):8.1f} us   p99 {p(xs, 0.99):8.1f} us")
    print(f"added by validation over the parse, p50: {statistics.median(check) - statistics.median(base):.1f} us")


if __name__ == "__main__":
    main()
