"""Passwords in URLs are never shown: one mask for log lines, settings errors and engine-block errors.
Standard library only, so that every part of the project (the engine layer too) can use it."""

from __future__ import annotations

import re

#: `scheme://user:password@` anywhere in a text (Redis, database, proxy and engine URLs).
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@")
MASK = "***"


def redact(text: str) -> str:
    """`text` with the password of every URL in it masked: redis://:***@host:6379/0."""
    return _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text)
