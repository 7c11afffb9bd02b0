"""One log format for every service."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    # HTTP clients log every request at INFO: a log line per call on the hot path.
    for noisy in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
