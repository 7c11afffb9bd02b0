"""One log format for every service."""

from __future__ import annotations

import logging
import sys

from ._redact import RedactingFormatter


def configure_logging(level: str, name: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    # No URL password reaches the log, whoever formats a URL into a message.
    handler.setFormatter(RedactingFormatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # HTTP clients log every request at INFO: a log line per call on the hot path.
    for noisy in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
