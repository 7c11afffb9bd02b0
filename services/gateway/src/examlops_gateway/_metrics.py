"""A metric's labelled child, looked up once per label values rather than on every call.

prometheus_client's `labels()` checks the values and takes a lock on every call; the hot path
counts each call in several metrics, so their children are kept here (the gateway never removes a
child, and label values on the hot path are bounded: routed models, projects, statuses).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8192)
def child(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, remembered."""
    return metric.labels(*values)
