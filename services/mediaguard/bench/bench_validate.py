"""Per-part cost of mediaguard's validator, against ``urllib.parse.urlsplit`` measured in the same run.

    PYTHONPATH=services/mediaguard/src .venv/bin/python services/mediaguard/bench/bench_validate.py

Each case validates a one-part request (``validate_messages`` end to end, so the message walk and
the rebuilt part are included); the baseline is ``urlsplit`` alone on the same URL, which parses
but checks nothing. Numbers are p50/p99 microseconds over many single calls.
"""

from __future__ import annotations

import argparse
import base64
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from examlops.engine import MultimodalPolicy
from examlops_mediaguard._validate import validate_messages

PNG_HEADER = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
# urlsplit is lru_cached since 3.11; the baseline must parse, not hit the cache.
SPLIT: Callable[[str], object] = getattr(urlsplit, "__wrapped__", urlsplit)


def measure(call: Callable[[], object], iterations: int) -> tuple[float, float]:
    """p50 and p99 of single calls, in microseconds (after a short warm-up, GC paused)."""
    for _ in range(min(200, iterations)):
        call()
    samples: list[int] = []
    gc.disable()
    try:
        for _ in range(iterations):
            start = time.perf_counter_ns()
            call()
            samples.append(time.perf_counter_ns() - start)
    finally:
        gc.enable()
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49] / 1000, cuts[98] / 1000


def one_part(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="calls per small case")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "media")
        os.mkdir(root)
        with open(os.path.join(root, "cat.png"), "wb") as handle:
            handle.write(PNG_HEADER + bytes(4096))
        policy = MultimodalPolicy(
            modality="vision",
            limit_mm_per_prompt={"image": 1},
            allowed_media_domains=["example.com"],
            allowed_local_media_path=root,
        )
        payload = base64.b64encode(PNG_HEADER + bytes((1 << 20) - len(PNG_HEADER))).decode()
        cases = [
            ("remote URL", "https://img.example.com/cats/1.png?sig=abc123&w=512", 1),
            ("1 MiB data: png", "data:image/png;base64," + payload, 10),
            ("file:// path", f"file://{root}/cat.png", 4),
        ]
        print(f"{'case':18} {'validate p50':>13} {'p99':>9} {'urlsplit p50':>13} {'p99':>9} "
              f"{'ratio p50':>10}")  # fmt: skip
        for name, url, divisor in cases:
            messages = one_part(url)
            validate_messages(messages, policy)  # fail loudly if the case is not accepted
            iterations = max(1000, args.iterations // divisor)
            v50, v99 = measure(partial(validate_messages, messages, policy), iterations)
            b50, b99 = measure(partial(SPLIT, url), iterations)
            print(f"{name:18} {v50:11.1f}us {v99:7.1f}us {b50:11.1f}us {b99:7.1f}us "
                  f"{v50 / b50:9.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
