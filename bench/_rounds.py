"""What a rounds-based benchmark's run is made of (bench_routing.py, bench_workers.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """Interleaved rounds of `requests` measured calls each, after `warmup` calls, a phase capped
    at `max_seconds`."""

    rounds: int
    requests: int
    warmup: int
    max_seconds: float
